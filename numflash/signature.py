"""The signature of a public function's call, as generated code: its plan key, and a matcher of
the calls that have one plan's key.

A repeated call looks up the plan of its signature (numflash.plans). Building the key (each
array's shape, strides, dtype, alignment and device, each flag's type and value) and hashing it
cost a decoding step 3.6-4.2 us of host time on the H200 machine, nearly its launch's 4.7-5.1
(docs/performance.md, "Host cost"). Both functions here are written out once per
public function (:class:`Signature`), without loops or helper calls over its parameters:

- :meth:`Signature.key` returns the call's key and its arrays' addresses in role order;
- :meth:`Signature.matcher` makes, for one key, a function that tells whether a call has that
  key without building it (comparisons that stop at the first difference) and returns the
  call's addresses, or None; :meth:`Signature.match_parts` gives its lines for a plan to write
  its replay after them (numflash.plans, ``Plan.run``). The public functions try their most
  recent plans' runs first (:class:`numflash.plans.Recent`) and build the key only when none
  takes the call.

A matcher accepts exactly the calls whose key equals its own, except that it compares dtypes
by identity (NumPy's dtypes of the built-in types are single objects): a call it turns away
still finds its plan by key. tests/test_signature.py checks that every part of a key,
changed alone, turns a call away.
"""

#: The kinds of parameter a signature holds, with the part of the key each gives:
#: ``array``: a CuPy array, (shape, strides, dtype, address % 16, device id), and its address;
#:     strides None where the array is C-contiguous (CuPy's ``_c_contiguous``, which ignores
#:     the strides of dimensions of extent 1: they address nothing, so such arrays of one
#:     shape and dtype lay out their elements alike and share a plan);
#: ``optional``: an array as ``array``, or None (None, address 0);
#: ``lengths``: an int, (type,), with its value in place of an address (a plan's replay checks
#:     it and writes it into the lengths array the full path made: numflash.plans), or an
#:     array as ``array``;
#: ``value``: a flag or scalar, (type, value): True and 1, 2 and 2.0 are different calls;
#: ``rows``: a packed batch's max length, (type, ``ROWS(value)``): the bound the full path
#:     makes of it (numflash.validation.packed_bound);
#: ``window``: the default window (None) or a window_size, (type, element types, value);
#: ``config``: a configuration or None, itself.
KINDS = ("array", "optional", "lengths", "value", "rows", "window", "config")
#: The kinds that may hold an array, each giving the call an address (0 where absent).
_ARRAY_KINDS = ("array", "optional", "lengths")


def _array_lines(name, index, pad):
    """Key part and address of array parameter ``name`` (role ``index``)."""
    return [
        f"{pad}d{index} = {name}.data",
        f"{pad}p{index} = d{index}.ptr",
        f"{pad}k{index} = ({name}.shape, None if {name}._c_contiguous else {name}.strides, "
        f"{name}.dtype, p{index} & 15, d{index}.device_id)",
    ]


def _key_source(parameters):
    lines = [f"def key({', '.join(name for name, _ in parameters)}):"]
    parts, roles = [], []
    for position, (name, kind) in enumerate(parameters):
        part = f"k{position}"
        if kind == "array":
            lines += _array_lines(name, position, "    ")
        elif kind == "optional":
            lines += [
                f"    if {name} is None:",
                f"        k{position} = None",
                f"        p{position} = 0",
            ]
            lines += ["    else:", *_array_lines(name, position, "        ")]
        elif kind == "lengths":
            lines += [f"    if isinstance({name}, int):"]
            lines += [
                f"        k{position} = ({name}.__class__,)",
                f"        p{position} = {name}",
            ]
            lines += ["    else:", *_array_lines(name, position, "        ")]
        elif kind == "value":
            part = f"({name}.__class__, {name})"
        elif kind == "rows":
            part = f"({name}.__class__, ROWS({name}))"
        elif kind == "window":
            part = f"None if {name} is DEFAULT_WINDOW else window_key({name})"
        else:  # a configuration (Signature checked every kind)
            part = name
        parts.append(part)
        if kind in _ARRAY_KINDS:
            roles.append(f"p{position}")
    lines.append(
        "    return (Cupy.get_device(), Cupy.current_stream().ptr, NAME, "
        f"{', '.join(parts)}, cache.generation), [{', '.join(roles)}]"
    )
    return "\n".join(lines) + "\n"


def _array_checks(name, index, contiguous, one_device, pad):
    """Lines that return None unless array ``name`` has the key part held in the constants
    c{index}_0 .. c{index}_4 (shape and strides as lists, dtype, alignment, device), and take
    its address. The shape and strides are read as CuPy keeps them, ``_shape`` and
    ``_strides`` (lists: the public tuples are made from them, at twice the cost); where the
    key's array was ``contiguous`` its flag is read instead of the strides (a bool, not a new
    list); the device is not compared where the process sees one device (every array is on
    it)."""
    layout = f"not {name}._c_contiguous" if contiguous else f"{name}._strides != c{index}_1"
    if one_device:
        device, lines = "", [f"{pad}p{index} = {name}.data.ptr"]
    else:
        device = f" or d{index}.device_id != c{index}_4"
        lines = [f"{pad}d{index} = {name}.data", f"{pad}p{index} = d{index}.ptr"]
    return lines + [
        f"{pad}if ({name}._shape != c{index}_0 or {layout} or "
        f"{name}.dtype is not c{index}_2 or p{index} & 15 != c{index}_3{device}):",
        f"{pad}    return None",
    ]


#: Whether a flag, scalar, window or configuration differs from the key's constant ``c``:
#: a scalar's type and value are two constants (``c_0``, ``c_1``), a bool is itself (True and
#: False are the only ones, so identity compares type and value at once).
_DIFFERS = {
    "bool": "{name} is not {c}",
    "value": "{name}.__class__ is not {c}_0 or {name} != {c}_1",
    "rows": "{name}.__class__ is not {c}_0 or ROWS({name}) != {c}_1",
    "window": "{name} is DEFAULT_WINDOW or window_key({name}) != {c}",
    "config": "{name}.__class__ is not {c}.__class__ or {name} != {c}",
}


def _match_body(parameters, parts, one_device):
    """(lines, constants, roles): the body of a function of the parameters that returns None
    unless the call has one key's parts (in parameter order) and otherwise goes on with the
    address of each array role in a local (``roles`` names them, in role order), and the
    constants it names. Flags and scalars are compared first: they are the cheapest to tell
    apart."""
    constants = {}
    flags, arrays, roles = [], [], []
    for position, ((name, kind), part) in enumerate(zip(parameters, parts)):
        c = f"c{position}"
        if kind in _ARRAY_KINDS:
            roles.append(f"p{position}")
            if part is None:  # an absent optional array
                flags.append(f"{name} is not None")
                arrays.append(f"    p{position} = 0")
            elif kind == "lengths" and len(part) == 1:  # an int: (type,)
                constants[c] = part[0]
                arrays += [
                    f"    if {name}.__class__ is not {c}:",
                    "        return None",
                    f"    p{position} = {name}",
                ]
            else:
                if kind == "optional":
                    flags.append(f"{name} is None")
                elif kind == "lengths":
                    flags.append(f"isinstance({name}, int)")
                shape, strides, *rest = part
                constants[f"{c}_0"] = list(shape)
                if strides is not None:
                    constants[f"{c}_1"] = list(strides)
                constants.update({f"{c}_{i}": value for i, value in enumerate(rest, 2)})
                arrays += _array_checks(name, position, strides is None, one_device, "    ")
        else:  # a flag or scalar, the window, the configuration
            if (part[1] if kind == "value" else part) is None:  # the default
                flags.append(f"{name} is not {'DEFAULT_WINDOW' if kind == 'window' else 'None'}")
            elif kind == "value" and part[0] is bool:
                constants[c] = part[1]
                flags.append(_DIFFERS["bool"].format(name=name, c=c))
            elif kind in ("value", "rows"):
                constants.update({f"{c}_0": part[0], f"{c}_1": part[1]})
                flags.append(_DIFFERS[kind].format(name=name, c=c))
            else:
                constants[c] = part
                flags.append(_DIFFERS[kind].format(name=name, c=c))
    lines = []
    if flags:
        lines += [f"    if {' or '.join(f'({flag})' for flag in flags)}:", "        return None"]
    device = "" if one_device else " or Cupy.get_device() != DEVICE"
    lines += [
        f"    if (cache.generation != GENERATION{device} or Cupy.current_stream().ptr != STREAM):",
        "        return None",
        *arrays,
    ]
    return lines, constants, roles


class Signature:
    """A public function's parameters, as (name, kind) in its order (kinds: :data:`KINDS`),
    with the generated :meth:`key` and the matchers of its keys. ``namespace``: what the
    generated code reads besides its arguments: ``Cupy`` (get_device, current_stream),
    ``cache`` (generation), ``DEFAULT_WINDOW``, ``window_key`` and ``ROWS``. ``output``: the
    parameter a replay writes its result into when given (``out``), if the function has one."""

    def __init__(self, name, parameters, namespace, output=None):
        for parameter, kind in parameters:
            if kind not in KINDS:
                raise ValueError(f"unknown parameter kind {kind!r} of {parameter!r}")
        self.name = name
        self.parameters = tuple(parameters)
        #: the positions of the parameters that may hold an array, and of ``out`` (None)
        self.array_positions = tuple(
            i for i, (_, kind) in enumerate(self.parameters) if kind in _ARRAY_KINDS
        )
        #: the positions of a packed batch's max lengths
        self.rows_positions = tuple(
            i for i, (_, kind) in enumerate(self.parameters) if kind == "rows"
        )
        names = [parameter for parameter, _ in self.parameters]
        self.out_position = None if output is None else names.index(output)
        self.namespace = dict(namespace, NAME=name)
        self.key_source = _key_source(self.parameters)
        namespace = dict(self.namespace)
        exec(compile(self.key_source, f"<numflash {self.name} signature>", "exec"), namespace)
        self.key = namespace["key"]

    def match_parts(self, key, one_device=False):
        """(head, namespace, roles) of a function that takes a call with key ``key`` (one
        this signature's :meth:`key` made) and goes on with its arrays' addresses: ``head``,
        its def line and the lines that return None unless the call has that key; what they
        name; the locals that then hold the addresses, in role order. ``one_device``: the
        process sees one device only. The lines read CuPy's own fields of an array: where
        they raise AttributeError (another kind of array, or a CuPy without them), the caller
        builds the key instead."""
        device, stream, name, *parts, generation = key
        if name != self.name or len(parts) != len(self.parameters):
            raise ValueError(f"not a key of {self.name}: {key!r}")
        body, constants, roles = _match_body(self.parameters, parts, one_device)
        names = ", ".join(name for name, _ in self.parameters)
        namespace = dict(self.namespace, **constants)
        namespace.update(GENERATION=generation, DEVICE=device, STREAM=stream)
        return [f"def match({names}):", *body], namespace, roles

    def matcher(self, key, one_device=False):
        """``match(*args)``: the call's addresses in role order if its key is ``key``, else
        None (:meth:`match_parts` says what it reads). ``match.source`` is its code."""
        head, namespace, roles = self.match_parts(key, one_device)
        source = "\n".join([*head, f"    return [{', '.join(roles)}]"]) + "\n"
        exec(compile(source, f"<numflash {self.name} signature>", "exec"), namespace)
        match = namespace["match"]
        match.source = source
        return match
