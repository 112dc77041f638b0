"""The one place that chooses a kernel family and its configuration for a call.

Order for a call without ``config=``: a tuned configuration for the problem's key (the user's
cache, then the shipped files: :func:`numflash.cache.lookup`), else the heuristic default of the
family the device prefers. Each heuristic number below names the GPU it was chosen on; the
measurements and the commands that reproduce them are in docs/performance.md. A family with a
module of its own (numflash/families/) registers its default and its rule here
(:func:`default_for`, :func:`forward_rule`, :func:`backward_rule`); the order in which the
rules are applied, and the thresholds between families, stay here.
"""

import dataclasses
import inspect

from . import cache
from . import config as configs
from .config import CONFIG_TYPES, tensor_core_backward_head_dim
from .kernels import decode, forward_sm90

Selection = cache.Selection


# -- heuristic defaults -----------------------------------------------------------------------

#: {family name: its heuristic default as a function of (head_dim as the kernels run it,
#: device or None, grid class, problem key or None)}, registered by :func:`default_for` on each
#: family's function.
_DEFAULTS = {}


def default_for(config_type):
    """Register the decorated function, of (head_dim[, device[, grid]]) and, where it names
    it, a keyword ``key`` (the call's cache.ProblemKey: its mask and seqlen bucket; None where
    no call is in view, as for a family's head dims), as the heuristic default of
    ``config_type``'s family."""

    def register(fn):
        parameters = inspect.signature(fn).parameters
        takes = len([p for p in parameters.values() if p.kind != p.KEYWORD_ONLY])
        keyed = "key" in parameters

        def default(head_dim, device, grid, key):
            args = (head_dim, device, grid)[:takes]
            return fn(*args, key=key) if keyed else fn(*args)

        _DEFAULTS[config_type.family] = default
        return fn

    return register


@default_for(configs.PortableConfig)
def default_portable_config(head_dim):
    # Two fp32 tiles of block_n x head_dim must fit in 48 KiB of static shared memory.
    return configs.PortableConfig(block_m=64, block_n=32 if head_dim <= 128 else 16)


@default_for(configs.PortableBackwardConfig)
def default_portable_backward_config(head_dim):
    """Two fp32 tiles fit the 48 KiB of static shared memory; untuned: these kernels are the
    correctness path, not the fast one."""
    if head_dim <= 64:
        return configs.PortableBackwardConfig(block_m=64, block_n=64)
    if head_dim <= 128:
        return configs.PortableBackwardConfig(block_m=32, block_n=32)
    return configs.PortableBackwardConfig(block_m=16, block_n=16)


@default_for(configs.TensorCoreConfig)
def default_tensor_core_config(head_dim):
    """The forward's tiles where nothing is tuned: the fastest configurations without a spill
    on the H200 (docs/performance.md, "Forward tiles"), used on other GPUs until tuned there
    (head_dim 256 takes 99 KiB of shared memory, sm_86's limit)."""
    if head_dim <= 64:  # two 16-row tiles a warp halve the ldmatrix traffic per mma
        return configs.TensorCoreConfig(
            block_m=128, block_n=64, num_warps=4, stages=3, q_in_registers=False
        )
    if head_dim <= 128:  # Q in registers or 64-key tiles spill at 255 registers
        return configs.TensorCoreConfig(
            block_m=128, block_n=32, num_warps=4, stages=2, q_in_registers=False
        )
    return configs.TensorCoreConfig(
        block_m=64, block_n=32, num_warps=4, stages=2, q_in_registers=False
    )


@default_for(configs.TensorCoreBackwardConfig)
def default_tensor_core_backward_config(head_dim, device=None):
    """The mma.sync backward's tiles (head_dim as padded): the first of a short list that fits
    ``device`` (any device when None). dQ from its own kernel everywhere (deterministic, and
    faster than the atomics on the H200). 64 x 128 up to head_dim 128 and 32 x 128 split over
    two blocks above were the fastest tilings on the H200 (docs/performance.md, "Backward
    tiles"); the rest of each list is for GPUs with less shared memory per block (sm_80:
    163 KiB, sm_86/89: 99 KiB), not measured there."""
    if head_dim > 128:
        candidates = [
            configs.TensorCoreBackwardConfig(32, 8, 2, head_split=2),
            configs.TensorCoreBackwardConfig(32, 4, 2, head_split=2),
            configs.TensorCoreBackwardConfig(16, 4, 1, head_split=2),
        ]
    else:
        candidates = [
            configs.TensorCoreBackwardConfig(64, 8, 2),
            configs.TensorCoreBackwardConfig(32, 4, 2),
            configs.TensorCoreBackwardConfig(16, 4, 1),
        ]
    for cfg in candidates:
        if device is None or not cfg.problems(head_dim, device):
            return cfg
    return candidates[-1]


@default_for(configs.PortableDecodeConfig)
def default_portable_decode_config(head_dim):
    # Two fp32 tiles of block_n x head_dim must fit in 48 KiB of static shared memory.
    return configs.PortableDecodeConfig(block_m=64, block_n=32 if head_dim <= 128 else 16)


#: The tensor-core decode tiles to try, best first (block_n, num_warps, stages), for a grid of
#: fewer blocks than two per multiprocessor and for more. On the H200 (fp16, head_dim 128,
#: benchmarks/bench_decode.py, docs/performance.md "Decode tiles"): 8 warps (one block per
#: SM) were fastest at batch 1, 8 and the speculative step, 3 slots within 2% of 2 on a
#: contiguous cache and 8% faster paged; at batch 64 (512 blocks) 4 warps and 3 slots, two
#: blocks per SM overlapping each other's start and end; rechecked at batch 8 with the swizzled
#: ring. The later entries are for head dims whose slots do not fit (not timed).
DECODE_TILES_FEW_BLOCKS = ((16, 8, 3), (16, 8, 2), (16, 4, 3), (16, 4, 2), (16, 2, 2))
DECODE_TILES_MANY_BLOCKS = ((16, 4, 3), (16, 4, 2), (16, 2, 2))


def grid_class(blocks, device):
    """A KV-cache call's grid class (cache.GRIDS) from its thread blocks without splits (batch x
    kv heads x blocks of 16 query rows): "many" from two a multiprocessor of ``device``."""
    return "many" if blocks >= 2 * device.multiprocessors else "few"


@default_for(configs.TensorCoreDecodeConfig)
def default_tensor_core_decode_config(head_dim, device=None, grid="few"):
    """The first of the decode tiles for a call of grid class ``grid`` (:func:`grid_class`)
    whose shared memory fits ``device``."""
    tiles = DECODE_TILES_MANY_BLOCKS if grid == "many" else DECODE_TILES_FEW_BLOCKS
    for t in tiles:
        config = configs.TensorCoreDecodeConfig(*t)
        if device is None or not config.problems(head_dim, device):
            return config
    return config


def default_config(family, head_dim, device, grid="few", key=None):
    """(head_dim the kernels run at, the family's heuristic configuration; for the tensor-core
    KV-cache kernel, that of grid class ``grid``; for a call's or a tuning study's problem
    ``key`` (cache.ProblemKey), the default for its mask and seqlen bucket where the family's
    depends on them)."""
    if family not in CONFIG_TYPES:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(CONFIG_TYPES)}")
    run_dim = CONFIG_TYPES[family]().kernel_head_dim(head_dim)
    return run_dim, _DEFAULTS[family](run_dim, device, grid, key)


# -- choosing for a call ----------------------------------------------------------------------

_memo = {}


def _tuned_or_default(family, problem, device, grid=""):
    """The family's tuned configuration for ``problem`` on ``device`` if the cache holds one,
    else its heuristic default; ``grid``: the KV-cache families' grid class. Memoised per
    (problem key, device): every call goes through here, and a repeated lookup costs one
    dictionary access."""
    seqlen = max(problem.seqlen_q, problem.seqlen_k)
    memo_key = (
        cache.generation,
        family,
        problem.dtype,
        problem.head_dim,
        problem.window_left < 0,
        problem.window_right,
        (seqlen - 1).bit_length(),
        grid,
        device,
    )
    choice = _memo.get(memo_key)
    if choice is None:
        head_dim = CONFIG_TYPES[family]().kernel_head_dim(problem.head_dim)
        key = cache.ProblemKey.of(
            family,
            problem.dtype,
            head_dim,
            problem.seqlen_q,
            problem.seqlen_k,
            problem.window_left,
            problem.window_right,
            grid,
        )
        default = default_config(family, problem.head_dim, device, grid or "few", key)[1]
        hit = cache.lookup(device.arch, key, feasible=lambda c: not c.problems(head_dim, device))
        if hit is None:
            choice = (Selection(default, "heuristic"), None)
        else:
            choice = (Selection(hit.config, hit.source), hit.time_ms)
        _memo[memo_key] = choice
    return choice


def on_tensor_cores(problem, device):
    """Whether a call without ``config=`` runs a tensor-core family: fp16 and bf16 on a GPU with
    mma.sync. float32 and older GPUs take the portable kernels; so does the simulator (it
    reports compute capability 5.2), where the tensor-core kernels run when a configuration
    asks for them or one is tuned."""
    return (
        problem.dtype in ("float16", "bfloat16")
        and not device.simulated
        and device.runs("mma.sync")
    )


#: {configuration type: rule(problem, device)}: the forward families with a rule of their
#: own, which a call without ``config=`` on tensor cores runs when their rule says so (tried in
#: registration order; registered by :func:`forward_rule`, in the family's module).
_FORWARD_RULES = {}


def _rule_into(rules, config_type):
    """A decorator that registers its function as ``config_type``'s rule in ``rules``."""

    def register(fn):
        rules[config_type] = fn
        return fn

    return register


def forward_rule(config_type):
    """Register the decorated function of (problem, device) as the rule of ``config_type``'s
    forward family: whether a call without ``config=`` runs it rather than the mma.sync
    forward."""
    return _rule_into(_FORWARD_RULES, config_type)


def forward_family(problem, device):
    """The forward family of a call without ``config=``: on tensor cores (fp16/bf16 from
    sm_80) the first family whose rule takes the call (the Hopper forward's: compute
    capability 9.x at the head dims it is faster at), else the mma.sync one; the portable one
    otherwise (and in the simulator). A call with a user's score_mod or mask_mod runs only
    families that take them (config.USER_MODS)."""
    if not on_tensor_cores(problem, device):
        return configs.PortableConfig.family
    mods = problem.mods is not None  # a user's score_mod, mask_mod: families with USER_MODS
    for config_type, rule in _FORWARD_RULES.items():
        if rule(problem, device) and (config_type.USER_MODS or not mods):
            return config_type.family
    return configs.TensorCoreConfig.family


#: Query rows of a dense forward call at or below which it runs on the split-KV decode kernel
#: (as an attention_with_kvcache call over k and v as the cache, nothing appended): that
#: kernel's block of 16 rows (kernels/decode.py ROWS) holds them, where a forward block of 64
#: to 256 rows would compute four times the rows there are or more, and it spreads the keys
#: over the multiprocessors, which a forward grid of one block a head cannot.
FEW_QUERY_ROWS = decode.ROWS


def few_query_rows(problem):
    """Whether a dense forward call has few enough query rows for the decode kernel (the
    caller then checks that kernel takes the call: :func:`decode_family`)."""
    return 1 <= problem.seqlen_q <= FEW_QUERY_ROWS and problem.batch >= 1


def forward(problem, device):
    """The forward configuration of a call without ``config=``: a tuned one of
    :func:`forward_family`'s family for the problem's key, else its heuristic default."""
    return _tuned_or_default(forward_family(problem, device), problem, device)[0]


def forward_varlen(problem, device):
    """The configuration of a packed-batch forward: the dense call's choice for the max lengths
    (tuned entries are looked up by the max lengths' bucket). At head_dim 128 the dense default
    (128 rows) costs the varlen kernel one register past 255, 8 bytes spilled on sm_90a, and
    is still the faster: on the H200 (fp16, 32768 tokens, benchmarks/bench_varlen.py --sweep)
    causal 2.51 ms against 2.82 for 64 rows, non-causal equal (docs/performance.md)."""
    return forward(problem, device)


def default_tensor_core_varlen_backward_config(head_dim, device=None):
    """The packed-batch mma.sync backward's tiles where nothing is tuned (head_dim as padded):
    the dense defaults, except 32 query rows a block at head_dim 128. The varlen dK/dV kernel
    keeps each sequence's offsets and lengths in registers, and at 64 x 8 warps that spills 56
    bytes on sm_90a (255 registers; the dense kernel fits in 255); 32 x 8 warps fits in 254
    (tests/compile_targets.py reports both)."""
    cfg = default_tensor_core_backward_config(head_dim, device)
    if head_dim == 128 and cfg.block_m == 64:
        return dataclasses.replace(cfg, block_m=32)
    return cfg


def backward_varlen(problem, device, deterministic):
    """The configuration of a packed-batch backward: the dense call's choice for the max
    lengths (tuned entries are looked up by the max lengths' bucket), with the varlen kernels'
    own tiles where that choice is the mma.sync heuristic."""
    choice = backward(problem, device, deterministic)
    if choice.source == "heuristic" and isinstance(choice.config, configs.TensorCoreBackwardConfig):
        head_dim = tensor_core_backward_head_dim(problem.head_dim)
        return Selection(default_tensor_core_varlen_backward_config(head_dim, device), "heuristic")
    return choice


#: {configuration type: rule(problem, device)}: the backward families with a rule of their
#: own, candidates of a call without ``config=`` beside the mma.sync backward where their rule
#: takes the call (registered by :func:`backward_rule`, in the family's module).
_BACKWARD_RULES = {}


def backward_rule(config_type):
    """Register the decorated function of (problem, device) as the rule of ``config_type``'s
    backward family: whether it is a candidate (tuned or by default) for a call without
    ``config=``, ahead of the mma.sync backward."""
    return _rule_into(_BACKWARD_RULES, config_type)


def backward(problem, device, deterministic):
    """The backward configuration of a call without ``config=``.

    fp16/bf16 on a GPU with mma.sync: a tuned configuration of the families whose rule takes
    the call (the Hopper backward's: its tiles fit, compute capability 9.x, head_dim 64 or 128
    as padded) or of the mma.sync family, the faster where several are tuned; else the first
    of them by default. The simulator
    runs the tensor-core families only when tuned. Everything else takes the portable kernels.
    A user's score_mod and mask_mod run in every backward family (config.USER_MODS).
    With ``deterministic`` a configuration that adds dQ up with atomics runs with the separate
    dQ kernel instead (same tiles).
    """
    portable = configs.PortableBackwardConfig.family
    if problem.dtype == "float32" or not device.runs("mma.sync"):
        return _tuned_or_default(portable, problem, device)[0]
    families = [c.family for c, rule in _BACKWARD_RULES.items() if rule(problem, device)]
    families.append(configs.TensorCoreBackwardConfig.family)
    choices = [_tuned_or_default(f, problem, device) for f in families]
    tuned = [(time_ms, i) for i, (c, time_ms) in enumerate(choices) if c.source != "heuristic"]
    if tuned:
        choice = choices[min(tuned)[1]][0]
    elif on_tensor_cores(problem, device):
        choice = choices[0][0]
    else:
        return _tuned_or_default(portable, problem, device)[0]
    if deterministic and not choice.config.dq_separate:
        config = dataclasses.replace(choice.config, dq_separate=True)
        return Selection(config, choice.source + ", dq_separate for deterministic=True")
    return choice


#: Most splits of one sequence's keys (flash-attn's bound too): past this, combining the
#: partials costs more than the parallelism gains. The tensor-core decode kernel sizes its
#: combine's shared memory for it.
MAX_SPLITS = decode.MAX_SPLITS
#: Query rows of a tensor-core decode block.
DECODE_ROWS = decode.ROWS


def decode_family(problem, device):
    """The tensor-core KV-cache kernel for fp16/bf16 on GPUs with mma.sync when the caches'
    rows can be read in place in 16-byte chunks; the portable one otherwise (and in the
    simulator)."""
    if on_tensor_cores(problem, device) and problem.head_dim % 8 == 0 and problem.cache_aligned:
        return configs.TensorCoreDecodeConfig.family
    return configs.PortableDecodeConfig.family


def _row_blocks(problem, rows):
    """Thread blocks of a decode call without splits: batch x kv heads x blocks of ``rows``
    of the GQA group's (head, query position) rows."""
    return problem.batch * problem.nheads_k * -(-problem.heads_per_kv * problem.seqlen_q // rows)


def decode_grid(problem, device):
    """The grid class of a KV-cache call (:func:`grid_class`), part of its tuning key."""
    return grid_class(_row_blocks(problem, DECODE_ROWS), device)


def _block_shape(config, problem, device):
    """(query rows, keys per tile, blocks of this configuration one multiprocessor holds)."""
    if isinstance(config, configs.TensorCoreDecodeConfig):
        head_dim = problem.head_dim
        smem = config.shared_memory_bytes(head_dim) + config.static_shared_memory_bytes(head_dim)
        # A multiprocessor has 1 KiB more shared memory than one block may take (sm_80-sm_90),
        # and the driver reserves 1 KiB of it per block.
        by_smem = (device.max_shared_per_block + 1024) // (smem + 1024)
        resident = max(1, min(by_smem, 2048 // config.threads))
        return DECODE_ROWS, config.num_warps * config.block_n, resident
    return config.block_m, config.block_n, 1


def split_count(config, problem, device):
    """Thread blocks sharing one sequence's keys, flash-attn's rule: no split while batch x kv
    heads x row blocks fill 80% of a wave (every multiprocessor holding as many blocks as fit),
    else the smallest count whose wave efficiency is within 95% of the best (flash-attn: 85%;
    decoding is bound by memory, and idle multiprocessors leave bandwidth unused), each split keeping
    at least one key tile, at most MAX_SPLITS."""
    rows, keys_per_tile, resident = _block_shape(config, problem, device)
    blocks = _row_blocks(problem, rows)
    wave = device.multiprocessors * resident
    if blocks >= 0.8 * wave:
        return 1
    # by the capacity, as flash-attn's rule (seqlen_k of the cache), also for an int
    # cache_seqlens: the choice must not hinge on a length that changes every decoding step,
    # so that one replay plan serves every step (numflash.plans); splits past a sequence's
    # end find no key and cost one empty block each
    most = max(1, min(MAX_SPLITS, -(-problem.capacity // keys_per_tile)))

    def efficiency(splits):
        n = blocks * splits
        return n / (-(-n // wave) * wave)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.95 * best)


#: New query rows of a KV-cache call above which it runs on the Hopper forward rather than
#: the split-KV decode kernel (chunked prefill), by how the forward reads the cache
#: (benchmarks/bench_prefill.py --crossover, docs/performance.md "Chunked prefill"). The
#: forward takes about the same time from 8 to 128 rows; the decode kernel's doubles past 16
#: rows at 4 query heads a KV head (its blocks hold 64 (head, row) pairs), and past 16 at 1 and
#: 8 too. On the H100 (2026-12-07; the decode kernel and contiguous forward time as on the
#: H200) the forward won from 17 rows at every one of those groups and layouts (1.14-1.8x),
#: the decode kernel up to 16 (tied at 1); over pages the forward reads by cp.async they
#: crossed near 48 (H200, an earlier forward).
PREFILL_ROWS = {"contiguous": 16, "large pages": 16, "small pages": 16, "paged by cp.async": 48}
#: Pages of this many rows or more load as few TMA boxes as a contiguous cache's tile.
LARGE_PAGE = 64


def prefill_rows(problem):
    """The PREFILL_ROWS entry of a KV-cache call's cache: its layout, and for a paged cache
    whether the forward's tiles (64 or 128 keys) load its pages by TMA, and in boxes of how
    many rows."""
    if not problem.paged:
        return PREFILL_ROWS["contiguous"]
    if not forward_sm90.paged_tma(problem.page_size, 64):
        return PREFILL_ROWS["paged by cp.async"]
    return PREFILL_ROWS["large pages" if problem.page_size >= LARGE_PAGE else "small pages"]


def prefill(problem, device):
    """Whether a KV-cache call runs on a forward family (the Hopper forward's: chunked
    prefill, long speculative drafts): more new query rows than :func:`prefill_rows`, no split
    count above 1 asked for, caches it reads in place (16-byte aligned rows, head_dim a
    multiple of 8), and a forward family that reads KV caches taking the call on this device
    (:func:`forward_family`)."""
    return (
        problem.seqlen_q > prefill_rows(problem)
        and problem.num_splits <= 1
        and problem.cache_aligned
        and problem.head_dim % 8 == 0
        and CONFIG_TYPES[forward_family(problem, device)].READS_KV_CACHE
    )


def prefill_config(config, problem):
    """A forward configuration as chunked prefill runs it over ``problem``'s cache (the
    family's ``for_kv_cache``)."""
    return config.for_kv_cache(problem)


def decode(problem, device, config=None):
    """(Selection, split count) of an ``attention_with_kvcache`` call: ``config`` when forced,
    else a tuned or default configuration of the Hopper forward's family where
    :func:`prefill` says so, of :func:`decode_family`'s otherwise; one split for the Hopper
    forward, else ``num_splits`` when the call gives one, else :func:`split_count`."""
    if config is not None:
        choice = Selection(config, "forced")
    elif prefill(problem, device):
        choice = _tuned_or_default(forward_family(problem, device), problem, device)[0]
        choice = choice._replace(config=prefill_config(choice.config, problem))
    else:
        family = decode_family(problem, device)
        choice = _tuned_or_default(family, problem, device, decode_grid(problem, device))[0]
    if choice.config.ROLE == "forward":  # chunked prefill: one pass over the keys
        return choice, 1
    if problem.num_splits > 0:
        return choice, min(problem.num_splits, MAX_SPLITS)
    return choice, split_count(choice.config, problem, device)
