"""Context parallelism: attention over a sequence split across GPUs (zigzag ring attention).

Each rank holds a slice of every sequence: with ``world`` ranks the sequence is cut into
``2 * world`` chunks and rank r holds chunks r and 2 world - 1 - r (:func:`shard`), which
gives every rank the same share of a causal mask's work. K and V slices travel around a ring
(rank r sends to r + 1 and receives from r - 1) while each rank computes on the slice it
holds, and the partial outputs are merged through their log-sum-exp:

- step 0, the rank's own K/V: causal attention of its two chunks on its two chunks (the local
  order is the global order, so the local causal mask is the global one);
- a K/V slice from a rank ``src < r``: its first chunk precedes both of r's query chunks and
  its second follows both, so all of r's queries attend to the first chunk, unmasked;
- from ``src > r``: r's second query chunk follows both of its chunks, its first precedes
  both, so the second query chunk attends to all of it, unmasked.

Without a causal mask every step is all queries on the whole slice. With a sliding window
each pair of a query chunk and a key chunk runs apart, cut to the rows and keys that see
something, the window moved to where the pair sits (:func:`_visible`). The merge runs in fp32:
new = logaddexp(lse, blk), out = e^{lse - new} out + e^{blk - new} blk_out, both weights at
most 1, so nothing overflows. The backward turns the same ring: K/V travel ahead while a second
ring carries each slice's dK/dV accumulators (fp32) from rank to rank, every rank adding its
part, until one last hop hands them to their owner; dQ adds up locally. Memory per rank does
not grow with the number of ranks: two K/V slices and one dK/dV pair in flight.

The ring moves arrays through a ``comm``: a CuPy NCCL communicator
(``cupy.cuda.nccl.NcclCommunicator``, one rank per GPU; transfers on a stream of their own,
grouped send/recv, bytes so that bf16 needs no NCCL type), or any object with the
:class:`LocalRing` interface (``rank``, ``size``, ``shift(arrays)``), which the tests use to
run several ranks in one process.
"""

import contextlib
import math
import os
import threading

import numpy as np

from . import api, arrays, launch, validation
from .kernels.jit import SIMULATOR

#: Numba's simulator runs one kernel at a time per process (a running kernel rebinds its
#: modules' ``cuda``): ranks of one process in the simulator take turns at the kernels.
_kernel_turn = threading.Lock() if SIMULATOR else contextlib.nullcontext()

__all__ = [
    "shard",
    "unshard",
    "ring_attention",
    "ring_attention_backward",
    "nccl_communicator",
    "nccl_communicators",
    "run_ranks",
    "LocalRing",
]


# -- the zigzag layout ------------------------------------------------------------------------


def _chunks(x, world, axis):
    n = x.shape[axis]
    if world < 1 or n % (2 * world):
        raise ValueError(
            f"shard: the length along axis {axis} ({n}) must divide into 2 x world = "
            f"{2 * world} equal chunks"
        )
    c = n // (2 * world)
    index = [slice(None)] * x.ndim

    def chunk(i):
        index[axis] = slice(i * c, (i + 1) * c)
        return x[tuple(index)]

    return chunk


def shard(x, rank, world, axis=1):
    """Rank ``rank``'s zigzag slice of ``x`` along ``axis``: chunks rank and 2 world - 1 - rank
    of its 2 world equal chunks, in that order (a new contiguous array)."""
    if not 0 <= rank < world:
        raise ValueError(f"shard: rank must be in [0, {world}); got {rank}")
    chunk = _chunks(x, world, axis)
    xp = arrays.array_module(x)
    return xp.concatenate([chunk(rank), chunk(2 * world - 1 - rank)], axis=axis)


def unshard(shards, axis=1):
    """The whole array from every rank's :func:`shard` slice, in rank order."""
    world = len(shards)
    if world < 1:
        raise ValueError("unshard: no shards")
    halves = [_chunks(s, 1, axis) for s in shards]
    order = [halves[r](0) for r in range(world)] + [halves[r](1) for r in reversed(range(world))]
    return arrays.array_module(shards[0]).concatenate(order, axis=axis)


# -- moving slices around the ring ------------------------------------------------------------


class LocalRing:
    """Ranks of one process as a ring, for tests and for the simulator: one endpoint per rank
    (:meth:`group`), each used from its own thread. ``shift(arrays)`` hands copies of
    ``arrays`` to rank + 1 and returns a handle whose ``wait()`` gives what rank - 1 handed on
    in its shift of the same number (every rank shifts in the same order, as NCCL pairs a
    peer's sends and receives in order)."""

    def __init__(self, rank, size, board):
        self.rank, self.size, self._board = rank, size, board
        self._shifts = 0

    @classmethod
    def group(cls, size):
        board = {"lock": threading.Condition(), "boxes": {}, "stopped": False}
        return [cls(rank, size, board) for rank in range(size)]

    def stop(self):
        """A rank gave up: every rank waiting on the ring raises instead of waiting on."""
        with self._board["lock"]:
            self._board["stopped"] = True
            self._board["lock"].notify_all()

    def shift(self, xs):
        copies = [arrays.array_module(x).array(x, copy=True) for x in xs]
        number, self._shifts = self._shifts, self._shifts + 1
        board = self._board
        with board["lock"]:
            board["boxes"][(self.rank + 1) % self.size, number] = copies
            board["lock"].notify_all()
        return _LocalPending(board, (self.rank, number))


class _LocalPending:
    def __init__(self, board, key):
        self.board, self.key = board, key

    def wait(self):
        board = self.board
        with board["lock"]:
            arrived = board["lock"].wait_for(
                lambda: self.key in board["boxes"] or board["stopped"], timeout=600
            )
            if board["stopped"] or not arrived:
                raise RuntimeError("LocalRing: a rank of the ring stopped")
            return board["boxes"].pop(self.key)


class _NcclRing:
    """A CuPy NCCL communicator as a ring: transfers as bytes on a stream of their own, after
    the work queued on the current stream; ``wait()`` makes the current stream wait for them."""

    def __init__(self, comm):
        import cupy

        self.comm = comm
        self.rank, self.size = comm.rank_id(), comm.size()
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def shift(self, xs):
        import cupy
        from cupy.cuda import nccl

        sent = [cupy.ascontiguousarray(x) for x in xs]
        received = [cupy.empty_like(x) for x in sent]
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        nccl.groupStart()
        for x, y in zip(sent, received):
            self.comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, after, self.stream.ptr)
            self.comm.recv(y.data.ptr, y.nbytes, nccl.NCCL_UINT8, before, self.stream.ptr)
        nccl.groupEnd()
        return _NcclPending(received, sent, self.stream.record())


class _NcclPending:
    def __init__(self, received, sent, done):
        self.received, self.sent, self.done = received, sent, done  # sent: alive until done

    def wait(self):
        import cupy

        cupy.cuda.get_current_stream().wait_event(self.done)
        return self.received


#: id(communicator) -> (the communicator, its _NcclRing): one transfer stream per
#: communicator, made on its first use (the communicator is kept, so its id stays its own).
_nccl_rings = {}
_nccl_rings_lock = threading.Lock()


def _ring(comm):
    if hasattr(comm, "shift") and hasattr(comm, "rank") and hasattr(comm, "size"):
        return comm
    if hasattr(comm, "rank_id") and hasattr(comm, "send"):
        with _nccl_rings_lock:
            found = _nccl_rings.get(id(comm))
            if found is None:
                found = _nccl_rings[id(comm)] = (comm, _NcclRing(comm))
        return found[1]
    raise TypeError(
        "comm must be a cupy.cuda.nccl.NcclCommunicator or a ring with rank, size and shift "
        f"(numflash.distributed.LocalRing); got {type(comm).__name__}"
    )


def nccl_communicator(rank, world, id_file):
    """The NCCL communicator of this process's rank, one process per GPU (select the GPU
    first: ``cupy.cuda.Device(i).use()``). Rank 0 makes NCCL's unique id and writes it to
    ``id_file`` (a path every process sees); the others wait for the file and read it. Launch
    with e.g. ``torchrun --nproc-per-node 2 script.py`` or ``mpirun -n 2``, each process taking
    its rank and world from the launcher's environment (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*)."""
    import time

    from cupy.cuda import nccl

    if rank == 0:
        uid = nccl.get_unique_id()
        tmp = f"{id_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(" ".join(map(str, uid)))
        os.replace(tmp, id_file)  # readers never see half a file
    else:
        deadline = time.monotonic() + 600
        while not os.path.exists(id_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nccl_communicator: rank 0 wrote no {id_file} in 600 s")
            time.sleep(0.05)
        with open(id_file) as f:
            uid = tuple(int(x) for x in f.read().split())
    return nccl.NcclCommunicator(world, uid, rank)


def nccl_communicators(devices):
    """One NCCL communicator per GPU in ``devices`` for a process that drives them all
    (``NcclCommunicator.initAll``); run each rank's ring calls from a thread of its own, its
    device current."""
    from cupy.cuda import nccl

    return nccl.NcclCommunicator.initAll(list(devices))


def run_ranks(fn, rings, devices=None, timeout=None):
    """``[fn(rank, rings[rank]) for every rank]``, each rank in a thread of its own: one process
    driving several GPUs (``nccl_communicators``) or the ranks of a :class:`LocalRing` group.
    With ``devices``, rank r runs with ``cupy.cuda.Device(devices[r])`` current. A rank that
    raises stops its ring where the ring can be stopped (``LocalRing.stop``), so that the other
    ranks raise instead of waiting for it (an NCCL ring cannot be: its ranks wait in NCCL);
    once every thread has ended, or ``timeout`` seconds have passed, the first failure is
    raised again as a RuntimeError naming its rank."""
    world = len(rings)
    results, errors = [None] * world, []

    def run(rank):
        try:
            with _device(devices, rank):
                results[rank] = fn(rank, rings[rank])
        except BaseException as exc:  # raised again below, with the rank
            errors.append((rank, exc))
            stop = getattr(rings[rank], "stop", None)
            if stop is not None:
                stop()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        rank, exc = errors[0]
        raise RuntimeError(f"rank {rank} failed: {exc!r}") from exc
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"ranks still running after {timeout} s")
    return results


def _device(devices, rank):
    """The context that makes rank ``rank``'s GPU current (nothing without ``devices``)."""
    if devices is None:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(devices[rank])


# -- the merge --------------------------------------------------------------------------------


def _merge(out, lse, rows, block_out, block_lse):
    """Fold one block's (out, lse) for query rows ``rows`` into the fp32 running (out, lse)."""
    xp = arrays.array_module(out)
    old = lse[:, :, rows]
    blk = block_lse.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        new = xp.logaddexp(old, blk)
        seen = new > -np.inf  # rows that saw no key yet keep out 0 and lse -inf
        keep = xp.where(seen, xp.exp(old - new), 0).astype(np.float32)
        take = xp.where(seen, xp.exp(blk - new), 0).astype(np.float32)
    # lse is (batch, heads, rows); out (batch, rows, heads, head_dim)
    out[:, rows] = (
        out[:, rows] * keep.transpose(0, 2, 1)[..., None]
        + arrays.to_float32(block_out) * take.transpose(0, 2, 1)[..., None]
    )
    lse[:, :, rows] = new


def _fold_sinks(out, lse, sinks):
    """Join each head's sink logit to every row's denominator once the ring is done: lse
    becomes logaddexp(lse, sink) and the fp32 out is rescaled by e^{lse - new} (0 for a row
    that saw no key, whose lse becomes its sink)."""
    xp = arrays.array_module(out)
    new = xp.logaddexp(lse, sinks.astype(np.float32)[None, :, None])
    with np.errstate(invalid="ignore"):
        keep = xp.where(lse > -np.inf, xp.exp(lse - new), 0).astype(np.float32)
    out *= keep.transpose(0, 2, 1)[..., None]
    lse[...] = new


def _sink_gradient(dout, q, k, v, out, lse, sinks):
    """This rank's part of dsinks: -sum over its batch rows and query rows of e^{sink - lse}
    rowsum(dout * out) (the lse holds the sinks), by the kernels attention_backward's dsinks
    comes from (launch.sink_gradient: fp32, a fixed order)."""
    p = validation.problem(q, k, v, False, None, (-1, -1))[-1]
    dsinks = arrays.array_module(q).zeros((p.nheads,), dtype=np.float32)
    if q.size:  # (no rows: no terms)
        with _kernel_turn:
            launch.sink_gradient(p, dout, out, lse, sinks, dsinks)
    return dsinks


# -- the ring ---------------------------------------------------------------------------------


def _visible(q_first, rows, k_first, keys, left, right):
    """The part of a block that a window hides nothing of at its edges: query rows [q_first,
    + rows) against keys [k_first, + keys) (global positions), where query p sees key t iff
    p - left <= t <= p + right (-1: unbounded). Returns (row slice, key slice, window_size for
    numflash.attention on that part, aligned bottom-right as it aligns) or None when no pair is
    visible: the rows that see nothing and the keys nobody sees are cut off, which leaves every
    bound non-negative."""
    shift = q_first - k_first  # key index of a row's own position, less the row's index
    i = np.arange(rows)
    lo = np.zeros(rows, np.int64) if left < 0 else i + shift - left
    hi = np.full(rows, keys - 1, np.int64) if right < 0 else i + shift + right
    seen = (hi >= 0) & (lo <= keys - 1) & (lo <= hi)
    if not seen.any():
        return None
    i0, i1 = int(i[seen][0]), int(i[seen][-1])
    j0, j1 = max(0, int(lo[i0])), min(keys - 1, int(hi[i1]))
    sq, sk = i1 - i0 + 1, j1 - j0 + 1
    offset = (sk - sq) - ((q_first + i0) - (k_first + j0))  # bottom-right alignment's shift
    window = (-1 if left < 0 else left + offset, -1 if right < 0 else right - offset)
    return slice(i0, i1 + 1), slice(j0, j1 + 1), window


def _pieces(rank, world, step, half, causal, window):
    """[(query rows, key rows, causal, window_size)] of step ``step`` on rank ``rank`` (local
    indices; ``half`` the chunk length). Without a window the zigzag rules of the module's
    docstring (one call a step); with one, each pair of a query chunk and a key chunk with the
    window moved to where the pair sits in the sequence, cut to what it sees."""
    everything = slice(None)
    src = (rank - step) % world
    if window == (-1, -1):
        if not causal:
            return [(everything, everything, False, window)]
        if step == 0:
            return [(everything, everything, True, window)]
        if src < rank:
            return [(everything, slice(0, half), False, window)]
        return [(slice(half, None), everything, False, window)]
    left, right = window[0], 0 if causal else window[1]
    out = []
    for qi, q_chunk in enumerate((rank, 2 * world - 1 - rank)):
        for ki, k_chunk in enumerate((src, 2 * world - 1 - src)):
            found = _visible(q_chunk * half, half, k_chunk * half, half, left, right)
            if found is not None:
                rows, keys, w = found
                rows = slice(qi * half + rows.start, qi * half + rows.stop)
                keys = slice(ki * half + keys.start, ki * half + keys.stop)
                out.append((rows, keys, False, w))
    return out


def _check(q, k, ring, window_size, name):
    window_size = tuple(int(w) for w in window_size)
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"{name}: window_size must be (left, right), each >= 0 or -1")
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"{name}: q, k, v are (batch, seqlen_local, heads, head_dim) shards")
    if q.shape[1] != k.shape[1] or q.shape[1] % 2:
        raise ValueError(
            f"{name}: q and k must be zigzag shards of one even length (numflash.distributed."
            f"shard); got seqlen_local {q.shape[1]} and {k.shape[1]}"
        )
    if ring.size < 1 or not 0 <= ring.rank < ring.size:
        raise ValueError(f"{name}: comm has rank {ring.rank} of {ring.size}")
    return window_size


def ring_attention(
    q, k, v, comm, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False,
    softcap=0.0, sinks=None,
):  # fmt: skip
    """Attention of this rank's zigzag shard of the queries over the whole sequence, whose K/V
    shards travel around the ring ``comm``. q, k, v: (batch, seqlen_local, heads, head_dim)
    shards (:func:`shard` along axis 1; GQA as in :func:`numflash.attention`); the result, and
    with ``return_lse`` the lse (batch, heads, seqlen_local, float32), are this rank's shards
    of what :func:`numflash.attention` gives on the whole sequence (same softmax_scale,
    causal, softcap and sinks semantics: the sinks, float32 (heads,), join every row once, after
    the ring). Every rank calls it together."""
    ring = _ring(comm)
    window = _check(q, k, ring, window_size, "ring_attention")
    sinks = validation.check_sinks(sinks, q, q.shape[2])
    xp = arrays.array_module(q)
    batch, seqlen, heads, head_dim = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = xp.zeros(q.shape, dtype=np.float32)
    lse = xp.full((batch, heads, seqlen), -np.inf, dtype=np.float32)
    kv = (k, v)
    for step in range(ring.size):
        pending = ring.shift(kv) if step + 1 < ring.size else None  # the next slice, in flight
        for rows, keys, blk_causal, blk_window in _pieces(
            ring.rank, ring.size, step, seqlen // 2, causal, window
        ):
            with _kernel_turn:
                blk_out, blk_lse = api.attention(
                    q[:, rows], kv[0][:, keys], kv[1][:, keys], causal=blk_causal,
                    softmax_scale=scale, window_size=blk_window, return_lse=True,
                    softcap=softcap,
                )  # fmt: skip
            _merge(out, lse, rows, blk_out, blk_lse)
        if pending is not None:
            kv = tuple(pending.wait())
    if sinks is not None:
        _fold_sinks(out, lse, sinks)
    result = arrays.from_float(out, q.dtype)
    return (result, lse) if return_lse else result


def ring_attention_backward(
    dout, q, k, v, out, lse, comm, *, causal=False, softmax_scale=None, window_size=(-1, -1),
    deterministic=False, softcap=0.0, sinks=None,
):  # fmt: skip
    """Gradients of :func:`ring_attention`: (dq, dk, dv), this rank's shards of what
    :func:`numflash.attention_backward` gives on the whole sequence, from this rank's shards of
    dout, q, k, v and the forward's out and lse. dK and dV of each K/V shard add up in fp32 as
    they travel the ring and reach their owner after ``size`` hops; dQ adds up locally, in ring
    order (with ``deterministic`` every kernel's order is fixed too). Give the forward's
    softcap and sinks: with sinks a fourth, dsinks (heads,) float32, this rank's part, summed
    over its own rows (the sum over the ranks, an all-reduce as for the model's other
    weights, is the whole sequence's). Every rank calls it together."""
    ring = _ring(comm)
    window = _check(q, k, ring, window_size, "ring_attention_backward")
    sinks = validation.check_sinks(sinks, q, q.shape[2])
    xp = arrays.array_module(q)
    seqlen, head_dim = q.shape[1], q.shape[3]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    dq = xp.zeros(q.shape, dtype=np.float32)
    kv = (k, v)
    dkv = (xp.zeros(k.shape, dtype=np.float32), xp.zeros(v.shape, dtype=np.float32))
    for step in range(ring.size):
        pending = ring.shift(kv) if step + 1 < ring.size else None
        for rows, keys, blk_causal, blk_window in _pieces(
            ring.rank, ring.size, step, seqlen // 2, causal, window
        ):
            with _kernel_turn:
                dq_blk, dk_blk, dv_blk = api.attention_backward(
                    dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows],
                    xp.ascontiguousarray(lse[:, :, rows]), causal=blk_causal,
                    softmax_scale=scale, window_size=blk_window, deterministic=deterministic,
                    softcap=softcap,
                )  # fmt: skip
            dq[:, rows] += arrays.to_float32(dq_blk)
            dkv[0][:, keys] += arrays.to_float32(dk_blk)
            dkv[1][:, keys] += arrays.to_float32(dv_blk)
        dkv = tuple(ring.shift(dkv).wait())  # on to the next rank, which adds its part
        if pending is not None:
            kv = tuple(pending.wait())
    # after ``size`` hops each slice's dK/dV came back around to its owner
    dk, dv = dkv
    grads = tuple(arrays.from_float(x, y.dtype) for x, y in ((dq, q), (dk, k), (dv, v)))
    return grads if sinks is None else (*grads, _sink_gradient(dout, q, k, v, out, lse, sinks))
