"""Search spaces derived from the configuration dataclasses.

Each field of a configuration declares its allowed values (``numflash.config.knob``). Fields
whose values are all powers of two are searched as log2 integers, as CuPy's optimizer does, so
that TPE sees their order; the rest (booleans, stage counts) are categorical.
"""

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
