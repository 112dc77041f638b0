"""Public functions: validate -> normalise -> choose the configuration -> get the kernel -> launch.

Nothing is launched and no output is touched until every argument has been checked; each bad
argument raises a ValueError or TypeError that names it, says what was given and what is
accepted.
"""

import contextlib
import dataclasses
import math
import numbers

import numpy as np

from . import arrays, cache, config as configs
from .device import PORTABLE_BACKWARD, TENSOR_CORE, TENSOR_CORE_BACKWARD, current_device
from .kernels import backward, backward_portable, backward_sm90, forward, forward_portable
from .kernels.jit import (
    Launcher,
    backward_signatures,
    forward_signature,
    tensor_core_backward_signature,
    tensor_core_dq_signature,
)
from .kernels.softmax import LOG2E

#: CUDA caps gridDim.y and gridDim.z at 65535; heads and batch are launched along them.
_MAX_GRID_YZ = 65535


@dataclasses.dataclass(frozen=True)
class _Problem:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: str
    scale: float
    window_left: int
    window_right: int


# -- validation ------------------------------------------------------------------------------------


def _shape_str(x):
    return "(" + ", ".join(str(n) for n in x.shape) + ")"


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def _check_window(window_size, causal):
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if ok:
        ok = all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1
            for w in window_size
        )
    if not ok:
        raise ValueError(
            "window_size must be a pair (left, right) of ints >= -1, -1 meaning unbounded; "
            f"got {window_size!r}"
        )
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0  # causal is the window (left, 0)
    return left, right


def _clamp_window(w, seqlen_q, seqlen_k):
    """A window wider than seqlen_q + seqlen_k hides nothing: say so with an int32 the kernels
    take (any reach beyond that bound sees the same keys)."""
    return w if w <= seqlen_q + seqlen_k else seqlen_q + seqlen_k


def _check_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale!r}")
    return scale


def _check_qkv(q, k, v):
    """Shapes, dtypes and devices of q, k, v; returns the dtype name."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, head_dim); "
                f"got shape {_shape_str(x)}"
            )
    devices = {name: arrays.device_id(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) > 1:
        raise ValueError(f"q, k and v must be on the same GPU; got devices {devices}")
    names = {name: arrays.dtype_name(x.dtype) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if names[name] is None:
            raise TypeError(
                f"{name} has dtype {x.dtype}; accepted: float16, bfloat16, float32"
            )
    if len(set(names.values())) > 1:
        raise TypeError(f"q, k and v must share one dtype; got {names}")
    b, sq, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"batch sizes differ: q {_shape_str(q)}, k {_shape_str(k)}, v {_shape_str(v)}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen; got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same nheads; got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(
            f"head_dim differs: q {d}, k {k.shape[3]}, v {v.shape[3]}; all three must match"
        )
    if not 1 <= d <= configs.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {configs.MAX_HEAD_DIM}]; got {d}")
    h_k = k.shape[2]
    if h_k == 0 or h % h_k:
        raise ValueError(
            f"nheads of q ({h}) must be a multiple of nheads of k and v ({h_k}) (GQA/MQA)"
        )
    if h > _MAX_GRID_YZ or b > _MAX_GRID_YZ:
        raise ValueError(f"nheads and batch must be at most {_MAX_GRID_YZ}; got {h} and {b}")
    return names["q"]


def _check_out(out, q):
    if out is None:
        return None
    out = arrays.intake(out, "out")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {_shape_str(q)}; got {_shape_str(out)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}; got {out.dtype}")
    if arrays.device_id(out) != arrays.device_id(q):
        raise ValueError(
            f"out is on device {arrays.device_id(out)} but q is on {arrays.device_id(q)}"
        )
    return out


def _check_like(x, name, like, like_name, dtype=None, shape=None):
    """``x`` adopted as an array with ``like``'s shape, dtype and device (or the given ones)."""
    x = arrays.intake(x, name)
    shape = like.shape if shape is None else shape
    dtype = like.dtype if dtype is None else dtype
    if x.shape != shape:
        what = f"{like_name}'s shape" if shape == like.shape else "shape"
        raise ValueError(f"{name} must have {what} ({', '.join(map(str, shape))}); "
                         f"got {_shape_str(x)}")  # fmt: skip
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}; got {x.dtype}")
    if arrays.device_id(x) != arrays.device_id(like):
        raise ValueError(
            f"{name} is on device {arrays.device_id(x)} but {like_name} is on "
            f"{arrays.device_id(like)}"
        )
    return x


def _check_config(config, problem, device):
    if config is None:
        return None
    if not isinstance(config, (configs.TensorCoreConfig, configs.PortableConfig)):
        raise TypeError(
            "config must be a numflash.TensorCoreConfig, a numflash.PortableConfig or None; "
            f"got {type(config).__name__}"
        )
    if config.family == TENSOR_CORE and problem.dtype == "float32":
        raise TypeError("config: the tensor-core kernel takes float16 or bfloat16, not float32")
    head_dim = problem.head_dim
    if config.family == TENSOR_CORE:
        head_dim = configs.round_up(head_dim, 8)
    reasons = config.problems(head_dim, device)
    if reasons:
        raise ValueError(f"config {config} cannot run here: " + "; ".join(reasons))
    return config


# -- launching -------------------------------------------------------------------------------------

_launchers = {}


def _cached_launcher(key, make):
    """The Launcher stored under ``key``; ``make()`` builds (and compiles) it on first use."""
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = _launchers[key] = make()
    return launcher


def _launcher(family, key):
    build = forward.build if family == TENSOR_CORE else forward_portable.build
    return _cached_launcher((family, key), lambda: Launcher(build(*key), forward_signature(key[1])))


def _launch_forward(cfg, p, q, k, v, out, lse):
    head_dim = q.shape[-1]
    if cfg.family == TENSOR_CORE:
        key = (head_dim, p.dtype, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages,
               cfg.q_in_registers)  # fmt: skip
        shared = cfg.shared_memory_bytes(head_dim)  # dynamic
    else:
        key = (head_dim, p.dtype, cfg.block_m, cfg.block_n)
        shared = 0  # static shared arrays
    launcher = _launcher(cfg.family, key)
    (qf, qs), (kf, ks), (vf, vs), (of, os_), (lf, _) = (
        arrays.kernel_view(x) for x in (q, k, v, out, lse)
    )
    args = (
        qf, kf, vf, of, lf,
        qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2],
        p.seqlen_q, p.seqlen_k, p.nheads // p.nheads_k,
        np.float32(p.scale * LOG2E), p.window_left, p.window_right,
    )  # fmt: skip
    grid = ((p.seqlen_q + cfg.block_m - 1) // cfg.block_m, p.nheads, p.batch)
    launcher(grid, cfg.threads, arrays.current_stream(), shared, args)


def _on_device(x):
    if isinstance(x, np.ndarray):
        return contextlib.nullcontext()
    return x.device


def _problem(q, k, v, causal, softmax_scale, window_size):
    """Validated arrays and the normalised problem they pose."""
    q = arrays.intake(q, "q")
    k = arrays.intake(k, "k")
    v = arrays.intake(v, "v")
    dtype = _check_qkv(q, k, v)
    causal = _check_flag(causal, "causal")
    left, right = _check_window(window_size, causal)
    scale = _check_scale(softmax_scale, q.shape[-1])
    b, sq, h, d = q.shape
    sk = k.shape[1]
    left, right = (_clamp_window(w, sq, sk) for w in (left, right))
    return q, k, v, _Problem(b, sq, sk, h, k.shape[2], d, dtype, scale, left, right)


# -- public ----------------------------------------------------------------------------------------


def selected_config(q, k, v, *, causal=False, window_size=(-1, -1), config=None):
    """The configuration ``attention(q, k, v, ...)`` would run with, and where it comes from.

    Returns ``(config, source)``: source is "forced" (``config=`` given), "user cache <path>",
    "shipped <path>" (tuned configurations in the user's cache or shipped with numflash, see
    ``numflash autotune``) or "heuristic". Takes the same arguments and raises the same errors
    as :func:`attention`; launches nothing.
    """
    q, k, v, p = _problem(q, k, v, causal, None, window_size)
    with _on_device(q):
        device = current_device()
        cfg = _check_config(config, p, device)
        if cfg is not None:
            return cache.Selection(cfg, "forced")
        return configs.choose_config(device.preferred_family(p.dtype), p, device)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
              return_lse=False, out=None, config=None):  # fmt: skip
    """Exact softmax attention, computed tile by tile on chip (FlashAttention).

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, nheads_k, head_dim), q's dtype; nheads % nheads_k == 0
            (grouped-query / multi-query attention). Any strides; arrays whose last dimension
            is contiguous are read in place, others copied.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q.
        softmax_scale: scale of q k^T before the softmax; default 1 / sqrt(head_dim).
        window_size: (left, right) sliding window, -1 meaning unbounded: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
        return_lse: also return the log-sum-exp of each row's scores.
        out: optional output array (q's shape and dtype) to write into.
        config: force a kernel configuration (:class:`numflash.TensorCoreConfig` or
            :class:`numflash.PortableConfig`); by default numflash chooses.

    Returns:
        out (q's shape and dtype), and with ``return_lse`` the tuple (out, lse) where lse is
        float32 (batch, nheads, seqlen_q), natural log. A row that sees no key gets output 0 and
        lse -inf.

    Kernels run on CuPy's current stream; the call returns without synchronising.
    """
    q, k, v, p = _problem(q, k, v, causal, softmax_scale, window_size)
    return_lse = _check_flag(return_lse, "return_lse")
    out = _check_out(out, q)
    b, sq, h, _ = q.shape
    with _on_device(q):
        device = current_device()
        cfg = _check_config(config, p, device)
        xp = arrays.array_module(q)
        if out is None:
            out = xp.empty(q.shape, dtype=q.dtype)
        lse = xp.empty((b, h, sq), dtype=xp.float32)
        if out.size:
            if p.seqlen_k == 0:  # nothing to attend to: every row is empty
                arrays.bits(out)[...] = 0
                lse[...] = -xp.inf
            else:
                _forward(p, q, k, v, out, lse, cfg, device)
    return (out, lse) if return_lse else out


def _positive_scale(q, scale):
    """(q', scale') with scale' > 0 and the same attention: the tensor-core kernel takes each
    row's max on unscaled scores, which only orders them right for a positive scale."""
    if scale > 0:
        return q, scale
    xp = arrays.array_module(q)
    if scale == 0:  # every visible score is 0: the same as q = 0 at any scale
        return xp.zeros(q.shape, dtype=np.uint16).view(q.dtype), 1.0  # 16-bit: only fp16/bf16 here
    # q.k * scale == (-q).k * |scale|; negate by flipping the sign bit (exact, bf16 included)
    flipped = xp.ascontiguousarray(arrays.bits(q)) ^ np.uint16(0x8000)
    return flipped.view(q.dtype), -scale


def _forward(p, q, k, v, out, lse, cfg, device):
    if cfg is None:
        cfg = configs.choose_config(device.preferred_family(p.dtype), p, device).config
    if cfg.family == TENSOR_CORE:
        q, scale = _positive_scale(q, p.scale)
        p = dataclasses.replace(p, scale=scale)
        head_dim = configs.round_up(p.head_dim, 8)
        if head_dim != p.head_dim:
            q, k, v = (arrays.pad_last_dim(x, head_dim) for x in (q, k, v))
        # cp.async moves 16 bytes: rows must start on 16-byte boundaries.
        q, k, v = (arrays.as_kernel_input(x, alignment_elements=8) for x in (q, k, v))
    else:
        head_dim = p.head_dim
        q, k, v = (arrays.as_kernel_input(x) for x in (q, k, v))
    direct = head_dim == p.head_dim and arrays.readable_in_place(out)
    target = out if direct else arrays.empty(q.shape[:-1] + (head_dim,), out.dtype, like=out)
    _launch_forward(cfg, p, q, k, v, target, lse)
    if not direct:
        arrays.bits(out)[...] = arrays.bits(target)[..., : p.head_dim]


# -- backward --------------------------------------------------------------------------------------


def selected_backward_config(q, k, v, *, causal=False, window_size=(-1, -1),
                             deterministic=False, config=None):  # fmt: skip
    """The configuration ``attention_backward`` would run with for these inputs, and where it
    comes from: ``(config, source)`` as :func:`selected_config` returns it. Launches nothing."""
    q, k, v, p = _problem(q, k, v, causal, None, window_size)
    deterministic = _check_flag(deterministic, "deterministic")
    with _on_device(q):
        cfg = _check_backward_config(config, p, deterministic)
        if cfg is not None:
            return cache.Selection(cfg, "forced")
        return _choose_backward(p, current_device(), deterministic)


#: Query rows (one warp each) per block of the D = rowsum(dO * O) kernel.
_PREPROCESS_ROWS = 8


def _choose_backward(p, device, deterministic):
    """The backward configuration of a call without ``config=`` (a cache.Selection).

    The tensor-core kernel for fp16/bf16: tuned, or its heuristic tiles where the forward too
    prefers the tensor cores (GPUs with mma.sync; the simulator takes it only when tuned).
    Else the portable kernels. With ``deterministic`` a tuned configuration that adds dQ up
    with atomics gets the separate dQ kernel instead (same tiles).
    """
    if p.dtype != "float32" and device.supports(TENSOR_CORE):
        selection = configs.choose_config(TENSOR_CORE_BACKWARD, p, device)
        if selection.source != "heuristic" or device.preferred_family(p.dtype) == TENSOR_CORE:
            if deterministic and not selection.config.dq_separate:
                return cache.Selection(dataclasses.replace(selection.config, dq_separate=True),
                                       selection.source + ", dq_separate for deterministic=True")
            return selection
    return configs.choose_config(PORTABLE_BACKWARD, p, device)


def _check_backward_config(config, p, deterministic):
    if config is None:
        return None
    device = current_device()
    if isinstance(config, configs.PortableBackwardConfig):
        head_dim = p.head_dim
    elif isinstance(config, configs.TensorCoreBackwardConfig):
        if p.dtype == "float32":
            raise TypeError("config: the tensor-core backward takes float16 or bfloat16, "
                            "not float32")  # fmt: skip
        if deterministic and not config.dq_separate:
            raise ValueError(
                "config: the tensor-core backward adds dQ up with atomics, in no fixed order; "
                "deterministic=True needs dq_separate=True (or the portable backward)"
            )
        head_dim = configs.tensor_core_backward_head_dim(p.head_dim)
        if not device.supports(TENSOR_CORE):
            raise ValueError(f"config: {device.name} ({device.arch}) has no mma.sync "
                             "(compute capability 8.0 or newer needed)")  # fmt: skip
    else:
        raise TypeError(
            "config must be a numflash.PortableBackwardConfig, a "
            f"numflash.TensorCoreBackwardConfig or None; got {type(config).__name__}"
        )
    reasons = config.problems(head_dim, device)
    if reasons:
        raise ValueError(f"config {config} cannot run here: " + "; ".join(reasons))
    return config


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window_size=(-1, -1), deterministic=False, config=None):  # fmt: skip
    """Gradients of :func:`attention`: ``(dq, dk, dv)`` of ``sum(out * dout)``.

    Args:
        dout: the gradient of the loss with respect to ``out``; q's shape and dtype.
        q, k, v: the forward's inputs.
        out, lse: the forward's outputs (``attention(..., return_lse=True)``); attention is
            recomputed from q, k and lse, never stored.
        causal, softmax_scale, window_size: as given to the forward call.
        deterministic: ask for bitwise reproducible gradients. The portable kernels and the
            tensor-core kernel with ``dq_separate=True`` (the default: a second kernel
            computes dQ in a fixed order) always are; a tensor-core configuration with
            ``dq_separate=False`` adds dQ up with atomics in no fixed order. With the flag, a
            tuned configuration of that kind runs with ``dq_separate=True`` instead, and a
            forced one is refused.
        config: force a :class:`numflash.PortableBackwardConfig`, or the tensor-core kernel
            with a :class:`numflash.TensorCoreBackwardConfig` (fp16/bf16; head_dim above 128
            needs ``head_split=2``).
            By default the tensor-core kernel runs for fp16/bf16 on GPUs with mma.sync
            (compute capability 8.0+), with its tiles from ``numflash autotune --family
            tensor-core-backward`` where tuned; the portable kernels run for float32 and
            older GPUs (:func:`selected_backward_config` tells which).

    Returns:
        dq with q's shape and dtype; dk and dv with k's shape and dtype. With GQA, dk and dv sum
        the contributions of every query head of their group. Rows that see no key contribute
        nothing; keys that no row sees get zero gradients.

    The portable kernels use fp32 math without tensor cores: correct everywhere, but two to
    three orders of magnitude slower than the tensor-core kernel. Kernels run on CuPy's
    current stream; the call returns without synchronising.
    """
    q, k, v, p = _problem(q, k, v, causal, softmax_scale, window_size)
    dout = _check_like(dout, "dout", q, "q")
    out = _check_like(out, "out", q, "q")
    b, sq, h, d = q.shape
    xp = arrays.array_module(q)
    lse = _check_like(lse, "lse", q, "q", dtype=np.dtype(np.float32), shape=(b, h, sq))
    deterministic = _check_flag(deterministic, "deterministic")
    with _on_device(q):
        cfg = _check_backward_config(config, p, deterministic)
        if cfg is None:
            device = current_device()
            cfg = _choose_backward(p, device, deterministic).config
        dq = xp.empty(q.shape, dtype=q.dtype)
        dk = xp.empty(k.shape, dtype=k.dtype)
        dv = xp.empty(v.shape, dtype=v.dtype)
        if p.seqlen_q == 0 or p.seqlen_k == 0 or dq.size == 0:
            for g in (dq, dk, dv):  # nothing attends: every gradient is 0
                arrays.bits(g)[...] = 0
        elif isinstance(cfg, configs.TensorCoreBackwardConfig):
            _backward_tensor_core(cfg, p, dout, q, k, v, out, lse, dq, dk, dv)
        else:
            _backward(cfg, p, dout, q, k, v, out, lse, dq, dk, dv)
    return dq, dk, dv


def _backward_launcher(kind, head_dim, dtype, *tiles):
    build = {"preprocess": backward_portable.build_preprocess,
             "dkdv": backward_portable.build_dkdv, "dq": backward_portable.build_dq}[kind]  # fmt: skip
    return _cached_launcher(("backward", kind, head_dim, dtype, tiles), lambda: Launcher(
        build(head_dim, dtype, *tiles), backward_signatures(dtype)[kind]))


def _backward_args(views, p):
    """A backward kernel's arguments from the (flat, strides) views of its arrays, in order:
    every array flat, then the (batch, seqlen, head) strides of the 4-D ones (all but LSE and
    D), then seqlen_q, seqlen_k, heads per kv head, softmax scale and the window."""
    strides = [s for _, st in views if len(st) == 4 for s in st[:3]]
    return (*(flat for flat, _ in views), *strides, p.seqlen_q, p.seqlen_k,
            p.nheads // p.nheads_k, np.float32(p.scale), p.window_left, p.window_right)  # fmt: skip


def _preprocess(p, dout, out, lse):
    """(lse as a contiguous array, D = rowsum(dout * out) in fp32), D computed on the GPU."""
    xp = arrays.array_module(out)
    lse = xp.ascontiguousarray(lse)
    delta = xp.empty(lse.shape, dtype=xp.float32)
    (do_flat, do_strides), (o_flat, o_strides) = (arrays.kernel_view(x) for x in (dout, out))
    grid = ((p.seqlen_q + _PREPROCESS_ROWS - 1) // _PREPROCESS_ROWS, p.nheads, p.batch)
    _backward_launcher("preprocess", p.head_dim, p.dtype, _PREPROCESS_ROWS)(
        grid, 32 * _PREPROCESS_ROWS, arrays.current_stream(), 0,
        (do_flat, o_flat, arrays.kernel_view(delta)[0], *do_strides[:3], *o_strides[:3],
         p.seqlen_q),
    )  # fmt: skip
    return lse, delta


#: Run the dQ kernel on a second stream beside the dK/dV kernel (neither reads what the other
#: writes), so that each can fill the SMs that the other's last wave leaves idle: at 32k tokens
#: x 2048 both kernels have 4096 equal blocks, one per SM at a time, which is 31.03 waves on
#: the H200's 132 SMs, the last of them 4 blocks. Off: on the H200 (2026-11-30,
#: ``benchmarks/backward_variants.py --kernel-variants``, head_dim 128) it gained 0.5% on
#: average over eight problems, some cells faster and some slower, inside the run-to-run noise.
_DQ_BESIDE_DKDV = False


def _backward_tensor_core(cfg, p, dout, q, k, v, out, lse, dq, dk, dv):
    """D, then the tensor-core dK/dV kernel; dQ either accumulated there in fp32 by atomics and
    then scaled and rounded, or (``dq_separate``) written by the dQ kernel."""
    xp = arrays.array_module(q)
    dout, out = (arrays.as_kernel_input(x) for x in (dout, out))
    lse, delta = _preprocess(p, dout, out, lse)
    head_dim = configs.tensor_core_backward_head_dim(p.head_dim)
    if head_dim != p.head_dim:
        q, k, v, dout = (arrays.pad_last_dim(x, head_dim) for x in (q, k, v, dout))
    q, k, v, dout = (arrays.as_kernel_input(x, alignment_elements=8) for x in (q, k, v, dout))
    direct = head_dim == p.head_dim
    dq_t, dk_t, dv_t = (g if direct else arrays.empty(g.shape[:-1] + (head_dim,), g.dtype, like=g)
                        for g in (dq, dk, dv))  # fmt: skip
    # dQ's fp32 accumulator for the atomics; a placeholder when the dQ kernel writes dQ itself
    acc_shape = (1, 1, 1, 1) if cfg.dq_separate else q.shape[:-1] + (head_dim,)
    dq_acc = xp.zeros(acc_shape, dtype=xp.float32)
    inputs = [arrays.kernel_view(x) for x in (q, k, v, dout, lse, delta)]
    tiles = (cfg.block_m, cfg.num_warps, cfg.stages)
    stream, smem = arrays.current_stream(), cfg.shared_memory_bytes(head_dim)
    dq_stream, join = stream, None
    if cfg.dq_separate and _DQ_BESIDE_DKDV:  # after D and the padded copies, before dK/dV
        dq_stream, join = arrays.side_stream()
    blocks = (p.seqlen_k + cfg.block_n - 1) // cfg.block_n * cfg.head_split
    _tensor_core_launcher("dkdv-wgmma" if cfg.wgmma else "dkdv", head_dim, p.dtype, tiles,
                          cfg.dq_separate, cfg.head_split)(
        (blocks, p.nheads_k, p.batch), cfg.threads, stream, smem,
        _backward_args(inputs + [arrays.kernel_view(x) for x in (dk_t, dv_t, dq_acc)], p))
    if cfg.dq_separate:
        blocks = (p.seqlen_q + cfg.block_n - 1) // cfg.block_n * cfg.head_split
        _tensor_core_launcher("dq-wgmma" if cfg.wgmma else "dq", head_dim, p.dtype, tiles, True,
                              cfg.head_split)(
            (blocks, p.nheads, p.batch), cfg.threads, dq_stream, smem,
            _backward_args(inputs + [arrays.kernel_view(dq_t)], p))
        if join is not None:
            join()
    else:
        arrays.round_scaled_into(dq, dq_acc[..., : p.head_dim], p.scale)
    if not direct:
        if cfg.dq_separate:
            arrays.bits(dq)[...] = arrays.bits(dq_t)[..., : p.head_dim]
        arrays.bits(dk)[...] = arrays.bits(dk_t)[..., : p.head_dim]
        arrays.bits(dv)[...] = arrays.bits(dv_t)[..., : p.head_dim]


def _tensor_core_launcher(kind, head_dim, dtype, tiles, dq_separate, head_split):
    """The Launcher of the tensor-core backward's "dkdv" or "dq" kernel, or of their Hopper
    versions "dkdv-wgmma" and "dq-wgmma" (built on first use)."""
    def make():
        if kind in ("dkdv-wgmma", "dq-wgmma"):
            _, num_warps, stages = tiles
            kernels = backward_sm90.build_kernels(head_dim, dtype, num_warps, stages)
            if kind == "dkdv-wgmma":
                return Launcher(kernels.dkdv, tensor_core_backward_signature())
            return Launcher(kernels.dq, tensor_core_dq_signature())
        if kind == "dkdv":
            return Launcher(backward.build(head_dim, dtype, *tiles, dq_separate=dq_separate,
                                           head_split=head_split),
                            tensor_core_backward_signature())  # fmt: skip
        return Launcher(backward.build_dq(head_dim, dtype, *tiles, head_split=head_split),
                        tensor_core_dq_signature())  # fmt: skip

    key = ("backward", "tensor-core", kind, head_dim, dtype, tiles, dq_separate, head_split)
    return _cached_launcher(key, make)


def _backward(cfg, p, dout, q, k, v, out, lse, dq, dk, dv):
    q, k, v, dout, out = (arrays.as_kernel_input(x) for x in (q, k, v, dout, out))
    lse, delta = _preprocess(p, dout, out, lse)
    inputs = [arrays.kernel_view(x) for x in (q, k, v, dout, lse, delta)]
    stream = arrays.current_stream()
    d, dtype = p.head_dim, p.dtype

    grid = ((p.seqlen_k + cfg.block_n - 1) // cfg.block_n, p.nheads_k, p.batch)
    _backward_launcher("dkdv", d, dtype, cfg.block_m, cfg.block_n)(
        grid, cfg.block_n, stream, 0,
        _backward_args(inputs + [arrays.kernel_view(dk), arrays.kernel_view(dv)], p))
    grid = ((p.seqlen_q + cfg.block_m - 1) // cfg.block_m, p.nheads, p.batch)
    _backward_launcher("dq", d, dtype, cfg.block_m, cfg.block_n)(
        grid, cfg.block_m, stream, 0, _backward_args(inputs + [arrays.kernel_view(dq)], p))
