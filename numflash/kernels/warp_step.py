"""One warp's FlashAttention-2 step on mma.sync: S = Q K^T, the online softmax, O += P V.

A warp owns ``m_tiles`` tiles of 16 query rows and keeps their accumulator ``acc``, running max
``m_i`` and running sum ``l_i`` in registers (C layout, :mod:`numflash.kernels.fragments`);
``s`` holds the scores of one key tile (``n_tiles`` tiles of 8 keys). Operands come from shared
memory through ldmatrix at a row pitch of ``row`` elements. The forward kernel runs this step
over its key tiles with every warp on its own rows; the decode kernel runs it with every warp
on its own keys and merges the warps' rows at the end.

Two shared-memory layouts. Padded: a row pitch 16 bytes past a multiple of 128, so that the 8
rows an ldmatrix reads at one column fall in different banks; each lane's address points at its
row and column. Swizzled (``swizzle``): unpadded rows, 128-byte aligned, whose 16-byte chunk c
of row r is stored at chunk ``swizzled_chunk(r, c)`` = c ^ (r mod 8); each lane's address
points at the start of its row and the step finds the chunk. Both keep ldmatrix free of bank
conflicts; only the swizzled one lets the cp.async copies that fill it write each 128-byte line
of global memory as one aligned 128-byte piece (why the decode kernel uses it).
"""

import functools
from typing import NamedTuple

from numba import cuda, float32, uint32

from . import ptx
from .fragments import MMA, PACK, acc_index
from .jit import device_function
from .softmax import shift_of


@device_function
def swizzled_chunk(row, chunk):
    """Where 16-byte chunk ``chunk`` of shared-memory row ``row`` is stored in the swizzled
    layout (rows of a multiple of 64 elements): its low three bits XOR the row's."""
    return chunk ^ (row & 7)


class WarpStep(NamedTuple):
    load_q_fragments: object  # (qf, q_addr, mt, kk, slot): Q rows of tile mt, columns 16 kk..
    mma_qk: object  # (qf, s, q_addr, k_addr): s = Q K^T, raw scores
    online_softmax: object  # (s, m_i, l_i, acc, scale_log2): absorb the tile, P left in s
    mma_pv: object  # (s, pf, acc, v_addr): acc += P V


@functools.lru_cache(maxsize=None)
def warp_step(
    dtype_name, m_tiles, n_tiles, head_dim_padded, row, q_in_registers, swizzle=False,
    offsets=False,
):  # fmt: skip
    """The device functions of one warp's step for these compile-time sizes: ``n_tiles``
    8-key tiles of scores (an even count), a head_dim padded to a multiple of 16; the
    swizzled layout with ``swizzle`` (head_dim_padded a multiple of 64, ``row`` equal to it)."""
    M_TILES, N_TILES, ROW, Q_IN_REGS, SWIZZLE = m_tiles, n_tiles, row, q_in_registers, swizzle
    OFFSETS = offsets
    if SWIZZLE and (row != head_dim_padded or row % 64):
        raise ValueError(f"the swizzled layout needs unpadded rows of 64k elements; got {row}")
    K_STEPS = head_dim_padded // 16  # k16 steps of S = Q K^T
    D_TILES = head_dim_padded // 8  # 8-column tiles of the output
    PV_STEPS = N_TILES // 2  # k16 steps of O += P V
    S_REGS = M_TILES * N_TILES * 4
    mma = MMA[dtype_name]
    pack = PACK[dtype_name]

    @device_function
    def column(addr, half, j):
        """The shared address of the lane's 16-byte chunk 2j + half of the row at ``addr``
        (every lane's row is 8-aligned plus lane % 8). Swizzled: rows start 128-byte aligned,
        and chunks 8a + b sit 128a bytes apart, so the XOR touches b alone."""
        if not SWIZZLE:
            return addr
        lane = cuda.threadIdx.x & 31
        # swizzled_chunk written out: calling it costs the decode main loop 13 instructions
        b = uint32(((2 * (j % 4) + half) ^ (lane & 7)) * 16)
        return addr + b + uint32((j // 4) * 128)

    @device_function
    def load_q_fragments(qf, q_addr, mt, kk, slot):
        """A fragment of Q rows (warp tile mt) x columns 16*kk.. into qf[slot..slot+3]."""
        if SWIZZLE:  # lanes 16..31 give the right 8 columns
            addr = column(q_addr, (cuda.threadIdx.x >> 4) & 1, kk)
            a0, a1, a2, a3 = ptx.ldmatrix_x4(addr, mt * 16 * ROW * 2)
        else:
            a0, a1, a2, a3 = ptx.ldmatrix_x4(q_addr, (mt * 16 * ROW + kk * 16) * 2)
        qf[slot] = a0
        qf[slot + 1] = a1
        qf[slot + 2] = a2
        qf[slot + 3] = a3

    @device_function
    def mma_qk(qf, s, q_addr, k_addr):
        """S = Q K_j^T for this warp's M_TILES x N_TILES fragments (fp32, zeroed first)."""
        for i in range(S_REGS):
            s[i] = float32(0.0)
        for kk in range(K_STEPS):
            if not Q_IN_REGS:
                for mt in range(M_TILES):
                    load_q_fragments(qf, q_addr, mt, kk, (mt * K_STEPS + kk) * 4)
            k_col = column(k_addr, (cuda.threadIdx.x >> 3) & 1, kk)  # lanes 8..15, 24..31: right
            for np_ in range(N_TILES // 2):
                # B fragments of key tiles 2*np_ and 2*np_+1 for columns 16*kk..16*kk+15
                if SWIZZLE:
                    b0, b1, b2, b3 = ptx.ldmatrix_x4(k_col, np_ * 16 * ROW * 2)
                else:
                    b0, b1, b2, b3 = ptx.ldmatrix_x4(k_addr, (np_ * 16 * ROW + kk * 16) * 2)
                for mt in range(M_TILES):
                    a = (mt * K_STEPS + kk) * 4
                    c = (mt * N_TILES + 2 * np_) * 4
                    s[c], s[c + 1], s[c + 2], s[c + 3] = mma(
                        qf[a],
                        qf[a + 1],
                        qf[a + 2],
                        qf[a + 3],
                        b0,
                        b1,
                        s[c],
                        s[c + 1],
                        s[c + 2],
                        s[c + 3],
                    )
                    c += 4
                    s[c], s[c + 1], s[c + 2], s[c + 3] = mma(
                        qf[a],
                        qf[a + 1],
                        qf[a + 2],
                        qf[a + 3],
                        b2,
                        b3,
                        s[c],
                        s[c + 1],
                        s[c + 2],
                        s[c + 3],
                    )

    @device_function
    def online_softmax(s, m_i, l_i, acc, scale_log2, t):
        """m_i, l_i and acc absorb the tile; P = exp2(S * scale_log2 - m_i) is left in s.

        ``s`` holds raw scores q.k (scale_log2 > 0 keeps their order), m_i is in the scaled
        log2 domain, so each probability costs one fma and one ex2. Built with ``offsets``,
        s holds each score less its row's offset ``t[r]`` (raw; forward.bias_scores), which
        joins the row's max and the exponent's shift; else ``t`` is not read.
        """
        for mt in range(M_TILES):
            for h in range(2):
                r = mt * 2 + h
                # -- row max over this thread's columns, then over the 4 lanes of the row
                m_raw = s[acc_index(mt * N_TILES, h)]
                for nt in range(N_TILES):
                    i = acc_index(mt * N_TILES + nt, h)
                    m_raw = max(m_raw, max(s[i], s[i + 1]))
                if OFFSETS:
                    m_raw += t[r]
                m_raw = max(m_raw, ptx.shfl_xor(m_raw, 1))
                m_raw = max(m_raw, ptx.shfl_xor(m_raw, 2))
                m_new = max(m_i[r], m_raw * scale_log2)
                shift = shift_of(m_new)
                alpha = ptx.exp2(m_i[r] - shift)
                m_i[r] = m_new
                neg_shift = ptx.fma(t[r], scale_log2, -shift) if OFFSETS else -shift
                # -- P = exp2(S - m); l_i keeps this thread's partial sum (reduced at the end)
                row_sum = float32(0.0)
                for nt in range(N_TILES):
                    i = acc_index(mt * N_TILES + nt, h)
                    s[i] = ptx.exp2(ptx.fma(s[i], scale_log2, neg_shift))
                    s[i + 1] = ptx.exp2(ptx.fma(s[i + 1], scale_log2, neg_shift))
                    row_sum += s[i] + s[i + 1]
                l_i[r] = l_i[r] * alpha + row_sum
                for dt in range(D_TILES):
                    i = acc_index(mt * D_TILES + dt, h)
                    acc[i] *= alpha
                    acc[i + 1] *= alpha

    @device_function
    def mma_pv(s, pf, acc, v_addr):
        """acc += P V_j, P packed to 16 bits from the score fragments once per k16 step."""
        for kk in range(PV_STEPS):
            for mt in range(M_TILES):
                # The accumulator layout of S tiles 2kk, 2kk+1 is the A layout of P.
                c = (mt * N_TILES + 2 * kk) * 4
                a = mt * 4
                pf[a] = pack(s[c], s[c + 1])
                pf[a + 1] = pack(s[c + 2], s[c + 3])
                pf[a + 2] = pack(s[c + 4], s[c + 5])
                pf[a + 3] = pack(s[c + 6], s[c + 7])
            for dp in range(D_TILES // 2):
                # B fragments of output column tiles 2*dp, 2*dp+1 for keys 16*kk..16*kk+15
                if SWIZZLE:  # lanes 16..31 give the right 8 columns
                    v_col = column(v_addr, (cuda.threadIdx.x >> 4) & 1, dp)
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(v_col, kk * 16 * ROW * 2)
                else:
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(v_addr, (kk * 16 * ROW + dp * 16) * 2)
                for mt in range(M_TILES):
                    a = mt * 4
                    o = (mt * D_TILES + 2 * dp) * 4
                    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(
                        pf[a],
                        pf[a + 1],
                        pf[a + 2],
                        pf[a + 3],
                        b0,
                        b1,
                        acc[o],
                        acc[o + 1],
                        acc[o + 2],
                        acc[o + 3],
                    )
                    o += 4
                    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(
                        pf[a],
                        pf[a + 1],
                        pf[a + 2],
                        pf[a + 3],
                        b2,
                        b3,
                        acc[o],
                        acc[o + 1],
                        acc[o + 2],
                        acc[o + 3],
                    )

    return WarpStep(load_q_fragments, mma_qk, online_softmax, mma_pv)
