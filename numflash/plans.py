"""Per-signature plans: a call's launches recorded once and replayed with new pointers.

A call of a public function validates, normalises, chooses a configuration, allocates and
packs kernel arguments: tens of microseconds of Python. What depends only on the call's
signature (shapes, strides, dtypes, pointer alignment, flags, device, stream) comes out the
same every time, so the first call with a signature runs the full path while
:func:`numflash.launch.recording` notes each launch (kernel, grid, block, shared memory, packed
arguments), and the calls after it with the same signature replay those launches with the new
arrays' pointers patched in.

A plan is made only when that replay is exact:

- every array of the call was used in place (its pointer is among the launches' arguments, at
  one place): an input the full path copied (a padded head_dim, misaligned rows, a negative
  scale) gives no plan;
- the full path did no device work besides the recorded launches (a copy back, a fill) that
  the replay would skip (:func:`numflash.launch.note_unrecorded_work`);
- the arrays the full path made for itself (split partials, stand-in index arrays, an lse
  nobody asked for, the decode kernel's arrival counters, which every launch leaves zero) keep
  their contents' meaning from call to call: they are kept by the plan and reused. Plans are
  per stream, so a reused buffer is only ever touched in stream order.

The signature key (numflash.signature) holds every argument that validation or the choice of
kernel reads, with its type, so a call reaching a plan is one the full path accepted before.
What depends on the arrays' addresses (an ``out=`` or a written cache overlapping an input) is
checked at every replay (:attr:`Plan.disjoint`). A replay's outputs are new arrays, or the ones
it returned last time when nothing refers to them any more (:meth:`Plan.output`). A replay is
one function written out for its plan (:meth:`Plan.replayer`): the checks, the outputs, the
pointer patches and the launches, without a loop or a call between them but CuPy's and the
driver's. A call first tries its function's most recently used plans (:class:`Recent`), each
through its :attr:`Plan.run`: the key's matcher, which compares the call with the key without
building the call's own, and the replay, in one function; a call none of them takes builds its
key and looks its plan up.
"""

import collections
import functools
import sys
import threading
import typing

#: Plans kept (the least recently looked up dropped first): a plan holds its recorded launches
#: and the buffers the full path made for itself.
MAX_PLANS = 256
#: The largest output a plan hands out again once its caller has let go of it (a decoding
#: step's at batch 512, 32 heads, head_dim 128, fp16): allocating one costs the host 1.8-3.7
#: us on the H200 machine (tools/launch_cost.py), which matters only beside kernels this
#: small, and a plan keeps the last output it returned alive until it hands it out again.
REUSE_BYTES = 4 << 20
#: How many plans' runs a function tries before building its key (numflash.signature):
#: enough for a model whose layers alternate between a few signatures (sliding-window and
#: global layers, say); a matcher whose flags differ from the call's stops at its first test.
RECENT = 4
#: Recent lists kept (PlanCache.recent_for): one a public function, and one a pair of max
#: lengths' bounds of the packed batches a training loop steps through.
MAX_RECENT_LISTS = 64


def _holders(x):
    """References to ``x``, its MemoryPointer and the memory under it: equal to the counts
    taken when the plan made ``x`` exactly when nothing outside the plan refers to any of them
    (no name, view, DLPack capsule, tensor or pointer object)."""
    data = x.data
    return sys.getrefcount(x), sys.getrefcount(data), sys.getrefcount(data.mem)


def _no_pairs(p):
    """The disjointness check of a plan that has no pairs to check."""
    return True


#: Compiled disjointness checks by source: the source names the roles' spans, which differ
#: by shape, instead of holding them, so every shape of a call kind compiles one check.
_checks = {}


def _disjoint_check(spans, overlaps):
    """A function of a call's pointers (in role order): whether no pair of roles in
    ``overlaps`` shares memory, each role spanning ``spans`` bytes. Written out as one
    expression over the pairs, each role's first and end address computed once (a KV-cache
    append checks twelve pairs every call; a loop over them costs the host twice as long).
    The last pointers found disjoint are kept (a copy): a call with the same pointers, as a
    decoding loop's over its caches, compares one list instead (about a tenth of the time).
    Compiled once per call kind (:data:`_checks`; compiling took about 40 us of a new shape's
    first call); no pairs: :func:`_no_pairs`."""
    if not overlaps:
        return _no_pairs
    roles = sorted({role for pair in overlaps for role in pair})
    terms = [f"a{a} < e{b} and a{b} < e{a}" for a, b in overlaps]
    lines = ["def disjoint(p):", "    if p == passed[0]:", "        return True"]
    lines += [f"    a{role} = p[{role}]; e{role} = a{role} + n{role}" for role in roles]
    lines += [f"    if {' or '.join(terms) or 'False'}:", "        return False"]
    lines += ["    passed[0] = list(p)", "    return True"]
    source = "\n".join(lines) + "\n"
    code = _checks.get(source)
    if code is None:
        code = _checks[source] = compile(source, "<numflash plan disjoint>", "exec")
    namespace = {f"n{role}": int(spans[role]) for role in roles}
    namespace["passed"] = [None]
    return _defined(code, namespace, "disjoint")


class Holder:
    """What a replay under stream capture pins (:meth:`PlanCache.pin`): the arrays whose
    addresses a plan's launches hold, which a CUDA graph may keep using."""

    __slots__ = ("keep", "pinned")

    def __init__(self, keep):
        self.keep = keep
        self.pinned = False


def _output(spares, alone, outputs, index, allocate):
    """:meth:`Plan.output` over a plan's spares, their holders and its outputs."""
    spare = spares[index]
    if spare is not None and _holders(spare) == alone[index]:
        return spare
    spare = allocate(*outputs[index])
    if spare.nbytes <= REUSE_BYTES:
        spares[index] = spare
        alone[index] = _holders(spare)
    return spare


def _defined(source, namespace, name):
    """The function ``name`` that ``source`` defines, run in ``namespace``, which keeps no
    reference to it: a function in its own globals is a reference cycle, which only the
    cyclic garbage collector frees, and it would hold its plan's buffers until then."""
    exec(source, namespace)
    return namespace.pop(name)


class Plan:
    """Recorded launches, replayed in order on one stream with the call's pointers. Nothing a
    plan refers to refers back to it (its replay's namespace holds its :class:`Holder`, not
    the plan), so a plan dropped from the cache frees its buffers at once."""

    __slots__ = ("launches", "keep", "spans", "overlaps", "disjoint", "lock", "holder")
    __slots__ += ("outputs", "spares", "alone", "replay", "replay_source", "run", "run_source")
    __slots__ += ("same", "fills", "deferred", "__weakref__")

    def __init__(self, launches, keep, spans, overlaps, outputs=(), same=(), fills=()):
        self.launches = launches
        self.keep = keep  # the arrays whose pointers the launches hold
        self.holder = Holder(keep)  # pinned once replayed under capture
        self.spans = spans  # bytes each role's array spans (its signature fixes them)
        self.overlaps = overlaps  # role pairs that must not share memory
        #: disjoint(pointers): whether those pairs do not overlap at these pointers
        self.disjoint = _disjoint_check(spans, overlaps)
        self.lock = threading.Lock()
        self.outputs = outputs  # (shape, dtype) of each output a replay makes, by index
        self.spares = [None] * len(outputs)  # the outputs last returned, by output index
        self.alone = [None] * len(outputs)  # ... and their _holders() while only the plan held them
        #: role pairs that were one array in the recorded call: the launches take the first's
        #: pointer for both, so a replay needs them one array again
        self.same = same
        #: (role, array, low, high) of each int length the call passed in place of an array
        #: (make's ``lengths``): the array the full path filled with it, refilled at replay
        self.fills = fills
        self.replay = self.replay_source = None  # :meth:`replayer`'s, once made
        self.run = self.run_source = None  # ... with the key's matcher, once made
        self.deferred = None  # :meth:`defer`'s writer of the replay

    @property
    def pinned(self):
        """Whether a replay under stream capture pinned the plan's buffers."""
        return self.holder.pinned

    def defer(self, write):
        """Put off writing the replay, ``write(plan)`` (which calls :meth:`replayer`), until
        :meth:`ready` is first called: writing and compiling it costs about a millisecond,
        which a signature seen once (a call of a new shape) never pays back. ``write`` takes
        the plan as its argument rather than holding it (no reference cycle)."""
        self.deferred = write

    def ready(self):
        """Write the replay :meth:`defer` put off, once (several threads may ask at once)."""
        if self.run is None and self.deferred is not None:
            with self.lock:
                if self.run is None:
                    self.deferred(self)
                    self.deferred = None
        return self

    def output(self, index, allocate):
        """Output ``index`` of a replay: the array this plan returned last time there if
        nothing else refers to it or its memory any more (the caller dropped it, as a decoding
        loop does), else a new one from ``allocate(shape, dtype)`` with the shape and dtype of
        :attr:`outputs` (the signature fixes them). Either way the kernels write all of it;
        replays run in stream order on one stream, as CuPy's memory pool reuses freed memory."""
        return _output(self.spares, self.alone, self.outputs, index, allocate)

    def replayer(self, stream, tail, allocate, capturing, pin, head=None, fill=None):
        """Set :attr:`replay` to a function written out for this plan (``replay_source`` is
        its code): ``replay(p, out)``, given a matching call's pointers in role order ``p``
        and its ``out`` argument, refuses it (None) where a pair of :attr:`overlaps` shares
        memory or a pair of ``tail.distinct`` shares an address, else takes each output
        ``tail.made`` names (:meth:`output`, ``allocate(shape, dtype)`` a new one), pins the
        plan's buffers through ``pin(holder)`` (its :class:`Holder`) the first time it
        replays while ``capturing(stream)`` (not checked on the legacy default stream, 0,
        which cannot capture; nor where the plan keeps nothing a graph could outlive),
        patches and launches every launch on ``stream`` under the plan's lock, and returns
        what ``tail.result`` names (docs/performance.md, "One replay function per plan").

        A replay also refuses a call whose roles that were one array in the recorded call
        (:attr:`same`) are not one again, or whose int length is outside its bounds; it
        writes each int length into its array (:attr:`fills`) through
        ``fill(address, value, count, stream)`` (cuMemsetD32Async: it returns (error,)) before
        the launches.

        With ``head`` (numflash.signature.Signature.match_parts of the plan's key), also set
        :attr:`run` (``run_source``): the key's matcher and the replay as one function of the
        call's arguments, which returns None where the call has another key or the replay
        refuses it."""
        output = functools.partial(_output, self.spares, self.alone, self.outputs)
        namespace = dict(holder=self.holder, disjoint=self.disjoint, output=output, lock=self.lock)
        namespace.update(spares=self.spares, alone=self.alone, holders=_holders)
        namespace.update(allocate=allocate, capturing=capturing, pin=pin, STREAM=stream)
        namespace.update(fill=fill, FillFailed=FillFailed)
        for i, prepared in enumerate(self.launches):
            namespace.update(prepared.namespace(f"s{i}"))
        roles = [f"p[{role}]" for role in range(len(self.spans))]
        lines = ["def replay(p, out):", *self._body(stream, tail, roles, "p")]
        self.replay_source = "\n".join(lines) + "\n"
        code = compile(self.replay_source, "<numflash plan replay>", "exec")
        self.replay = _defined(code, namespace, "replay")
        if head is not None:
            lines, matched, roles = head
            lines = [lines[0].replace("def match(", "def run("), *lines[1:]]
            lines += self._body(stream, tail, roles, f"[{', '.join(roles)}]")
            self.run_source = "\n".join(lines) + "\n"
            namespace.update(matched)
            code = compile(self.run_source, "<numflash plan run>", "exec")
            self.run = _defined(code, namespace, "run")

    def _body(self, stream, tail, roles, pointers):
        """The lines of a replay once its pointers are known: ``roles[r]`` is the expression
        of role r's address, ``pointers`` that of the list of them (for the overlap check);
        :meth:`replayer` says what they do."""
        lines = []
        refused = [f"not disjoint({pointers})"] if self.overlaps else []
        refused += [f"{roles[a]} == {roles[b]}" for a, b in tail.distinct]
        refused += [f"{roles[a]} != {roles[b]}" for a, b in self.same]
        refused += [f"not {low} <= {roles[r]} <= {high}" for r, _, low, high in self.fills]
        if refused:
            lines += [f"    if {' or '.join(refused)}:", "        return None"]
        made = {}
        for index, role in tail.made:
            lines += [  # Plan.output, its usual case (the last output handed out again) inline
                f"    o{index} = spares[{index}]",
                f"    if o{index} is None or holders(o{index}) != alone[{index}]:",
                f"        o{index} = output({index}, allocate)",
                f"    r{role} = o{index}.data.ptr",
            ]
            made[role] = f"r{role}"
        if self.keep and stream != 0:
            lines += ["    if not holder.pinned and capturing(STREAM):", "        pin(holder)"]
        lines.append("    with lock:")
        for role, lengths, _, _ in self.fills:
            lines += [
                f"        if fill({lengths.data.ptr}, {roles[role]}, {lengths.size}, STREAM)[0]:",
                "            raise FillFailed()",
            ]
        for i, prepared in enumerate(self.launches):
            lines += prepared.lines(f"s{i}", lambda r: made.get(r) or roles[r], "STREAM", " " * 8)
        returned = ["out" if index is None else f"o{index}" for index in tail.result]
        lines.append(f"    return {returned[0] if len(returned) == 1 else ', '.join(returned)}")
        return lines


class FillFailed(RuntimeError):
    """The driver refused to write a replay's int length into its array."""

    def __init__(self):
        super().__init__("cuMemsetD32Async failed writing a KV-cache length for a replay")


class Tail(typing.NamedTuple):
    """What a replay of one public function's plan does besides its launches (the call's
    flags fix it): ``made``, (output index, role) of each output the replay takes, in order;
    ``result``, the output index of each item it returns (None: the ``out`` it was given), one
    item returned alone; ``distinct``, role pairs that must not share an address."""

    made: tuple
    result: tuple
    distinct: tuple = ()


class Recent:
    """A function's most recently replayed plans, newest first, at most :data:`RECENT`:
    ``entries`` holds their :attr:`Plan.run` functions (the key's matcher and the replay in
    one). Read without a lock: the tuple is replaced whole."""

    def __init__(self):
        self.entries = ()
        self._lock = threading.Lock()

    def add(self, run):
        with self._lock:
            kept = tuple(entry for entry in self.entries if entry is not run)
            self.entries = (run, *kept)[:RECENT]


class PlanCache:
    """Plans by signature key, at most MAX_PLANS, safe from several threads. A plan replayed
    under stream capture is pinned: a CUDA graph holds the addresses of its buffers, so they
    live as long as the process."""

    def __init__(self):
        self._plans = collections.OrderedDict()
        self._pinned = []
        self._lock = threading.Lock()
        #: the :class:`Recent` plans of each public function, by its signature's name (a
        #: packed batch's with its max lengths' bounds: numflash.api._recent), at most
        #: MAX_RECENT_LISTS (:meth:`recent_for`)
        self.recent = {}

    def get(self, key):
        """The plan of ``key`` (None if there is none), now the most recently used."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key, plan):
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)

    def recent_for(self, key):
        """The :class:`Recent` list of ``key``, made on first use. A recent list keeps its
        plans' runs, and so their buffers, after the cache dropped them: past
        MAX_RECENT_LISTS lists (packed batches over ever more bounds) all are dropped."""
        found = self.recent.get(key)
        if found is None:
            with self._lock:
                if len(self.recent) >= MAX_RECENT_LISTS:
                    self.recent.clear()
                found = self.recent.setdefault(key, Recent())
        return found

    def pin(self, holder):
        """Keep a plan's buffers (its :class:`Holder`) alive for good."""
        with self._lock:
            if not holder.pinned:
                holder.pinned = True
                self._pinned.append(holder)

    def clear(self):
        """Forget every plan not pinned, and which plans were used last."""
        with self._lock:
            self._plans.clear()
            self.recent.clear()


def _span(x):
    """Bytes from x's first element's address past its last (x has non-negative strides)."""
    if x.size == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(x.shape, x.strides)) + x.dtype.itemsize


def _layout(x):
    return x.shape, x.strides, x.dtype


def make(recorded, roles, overlaps=(), outputs=(), lengths=()):
    """The plan of a recorded call, or None where a replay would not be exact.

    ``roles``: the call's arrays in role order (None for an absent one), each of which must
    appear, by its pointer, among the recorded launches' array arguments; roles at one
    address must be one array (the same elements: shape, strides and dtype), which the
    launches read through the first of them, and the plan replays only calls where they are
    one array again (:attr:`Plan.same`); ``overlaps``: pairs of role indices that must not
    share memory at replay (validation refused it); ``outputs``: (shape, dtype) of each output
    a replay makes (:meth:`Plan.output`); ``lengths``: (role, low, high) of each int length
    the call passed (its role None in ``roles``), in the order the full path filled arrays
    with them (``recorded.fills``: the first of them), with the bounds the full path checked
    it against. A fill no length names holds what the signature fixes (the keys of k's shape
    where `attention` runs the KV-cache kernel over k and v) and is kept as it is."""
    if recorded.unrecorded_work or not recorded.launches:
        return None
    if len(lengths) > len(recorded.fills):
        return None  # a length that filled nothing
    present = {i: x for i, x in enumerate(roles) if x is not None}
    by_pointer = {}
    for i, x in present.items():
        if any(s < 0 for s in x.strides):
            return None  # a replay patches x.data.ptr; the kernel took the lowest address
        by_pointer.setdefault(x.data.ptr, []).append(i)
    same = []
    for found in by_pointer.values():
        if any(_layout(present[i]) != _layout(present[found[0]]) for i in found[1:]):
            return None  # two arrays at one address: which one a slot holds is unknown
        same += [(found[0], i) for i in found[1:]]
    prepared, seen, keep = recorded.prepare(by_pointer)
    if seen != set(present):
        return None  # an array was copied or padded before the kernel read it
    for a, b in same:  # one of them copied, the other read in place, would look the same
        if any(_layout(x) == _layout(present[a]) for x in keep):
            return None
    spans = [0 if x is None else _span(x) for x in roles]
    overlaps = tuple((a, b) for a, b in overlaps if a in present and b in present)
    fills = tuple((role, x, low, high) for (role, low, high), x in zip(lengths, recorded.fills))
    return Plan(prepared, keep, spans, overlaps, outputs, tuple(same), fills)
