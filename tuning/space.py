"""Search spaces derived from the configuration dataclasses.

Each field of a configuration declares its allowed values (``numflash.config.knob``). Fields
whose values are all powers of two are searched as log2 integers, as CuPy's optimizer does, so
that TPE sees their order; the rest (booleans, stage counts) are categorical.
"""

import dataclasses
import itertools

from numflash.config import knob_choices


def _is_log2(choices):
    return all(
        isinstance(c, int) and not isinstance(c, bool) and c > 0 and c & (c - 1) == 0
        for c in choices
    )


def params(config_type):
    """{Optuna parameter name: (kind, values)} of a configuration type's space."""
    out = {}
    for name, choices in knob_choices(config_type).items():
        if _is_log2(choices):
            out[f"{name}_log2"] = ("log2", tuple(c.bit_length() - 1 for c in choices))
        else:
            out[name] = ("categorical", tuple(choices))
    return out


def suggest(trial, config_type):
    """The configuration an Optuna trial proposes."""
    values = {}
    for pname, (kind, choices) in params(config_type).items():
        if kind == "log2":
            values[pname[: -len("_log2")]] = 1 << trial.suggest_int(
                pname, min(choices), max(choices)
            )
        else:
            values[pname] = trial.suggest_categorical(pname, list(choices))
    return config_type(**values)


def as_params(config):
    """Optuna parameters that make :func:`suggest` return ``config`` (for enqueue_trial)."""
    out = {}
    for pname, (kind, _) in params(type(config)).items():
        if kind == "log2":
            out[pname] = getattr(config, pname[: -len("_log2")]).bit_length() - 1
        else:
            out[pname] = getattr(config, pname)
    return out


def all_points(config_type):
    """Every configuration of the space (feasible or not)."""
    choices = knob_choices(config_type)
    for combo in itertools.product(*choices.values()):
        yield config_type(**dict(zip(choices, combo)))


def feasible_points(config_type, head_dim, device):
    """The configurations that can run ``head_dim`` on ``device`` (the rest are pruned)."""
    return [cfg for cfg in all_points(config_type) if not cfg.problems(head_dim, device)]


def neighbours(config, head_dim, device):
    """The feasible configurations that differ from ``config`` in one knob, nearest first: by
    the distance of the knob's value from ``config``'s in its list of choices, then by knob
    (every knob's values next to the default before any knob's farther ones). A study tries
    them right after the default, so a small budget still sweeps each knob near it, and the
    tile size that fits a short sequence (the Hopper forward's 128 keys against the default
    192 at seqlen 1024) is among the first."""
    ranked = []
    for k, (name, choices) in enumerate(knob_choices(type(config)).items()):
        at = choices.index(getattr(config, name))
        ranked += [(abs(i - at), k, i, name, c) for i, c in enumerate(choices) if i != at]
    ranked.sort(key=lambda r: r[:3])
    found = [dataclasses.replace(config, **{name: c}) for *_, name, c in ranked]
    return [c for c in found if not c.problems(head_dim, device)]
