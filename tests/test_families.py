"""The registry of kernel families (numflash.config.CONFIG_TYPES): each family registered once,
with what it computes and needs, a heuristic default (numflash.selection) and a launch builder
(numflash.launch), and the device checks that follow from what it needs."""

import pytest

from numflash import launch, selection
from numflash.config import CONFIG_TYPES, HARDWARE, ROLES, families
from numflash.device import DeviceInfo

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 1024)
A100 = DeviceInfo("NVIDIA A100", (8, 0), 108, 166912, 1024)
T4 = DeviceInfo("Tesla T4", (7, 5), 40, 65536, 1024)


@pytest.mark.parametrize("name", sorted(CONFIG_TYPES))
def test_each_family_has_a_role_hardware_default_and_launcher(name):
    config_type = CONFIG_TYPES[name]
    assert config_type.family == name
    assert config_type.ROLE in ROLES and config_type.HARDWARE in HARDWARE
    assert config_type in families(config_type.ROLE)
    assert callable(launch.LAUNCHERS[config_type])
    for head_dim in (64, 128):
        run_dim, default = selection.default_config(name, head_dim, H200)
        assert type(default) is config_type and run_dim >= head_dim


def test_every_launcher_belongs_to_a_registered_family():
    assert set(launch.LAUNCHERS) == set(CONFIG_TYPES.values())


def test_roles_partition_the_families():
    by_role = [c for role in ROLES for c in families(role)]
    assert sorted(c.family for c in by_role) == sorted(CONFIG_TYPES)


@pytest.mark.parametrize(
    "device,runs",
    [
        (H200, {"portable", "mma.sync", "wgmma"}),
        (A100, {"portable", "mma.sync"}),
        (T4, {"portable"}),
    ],
)
def test_a_device_runs_the_families_whose_hardware_it_has(device, runs):
    for name, config_type in CONFIG_TYPES.items():
        assert device.runs(config_type.HARDWARE) == (config_type.HARDWARE in runs), name
    with pytest.raises(ValueError, match="unknown hardware"):
        device.runs("tcgen05")


def test_the_hopper_families_are_declared_in_their_own_modules():
    """The Hopper forward's and backward's configuration, default, rule and launch builders
    come from numflash/families/wgmma_forward.py and wgmma_backward.py, and no generic module
    names their configuration types or modules in code (docstrings may): adding a family is
    its modules and one registration line."""
    import ast
    from pathlib import Path

    from numflash.families import wgmma_backward, wgmma_forward

    forward = wgmma_forward.WgmmaForwardConfig
    backward = wgmma_backward.WgmmaBackwardConfig
    for module, config_type, rules in (
        (wgmma_forward, forward, selection._FORWARD_RULES),
        (wgmma_backward, backward, selection._BACKWARD_RULES),
    ):
        assert config_type.__module__ == module.__name__
        assert CONFIG_TYPES[config_type.family] is config_type
        assert launch.LAUNCHERS[config_type].__module__ == module.__name__
        assert rules[config_type].__module__ == module.__name__
    assert launch.PREFILL_LAUNCHERS[forward].__module__ == wgmma_forward.__name__
    assert selection.default_config(forward.family, 64, H200)[1] == (
        wgmma_forward.default_wgmma_forward_config(64)
    )
    assert selection.default_config(backward.family, 64, H200)[1] == (
        wgmma_backward.default_wgmma_backward_config(64)
    )
    names = ("WgmmaForwardConfig", "WgmmaBackwardConfig", "wgmma_forward", "wgmma_backward")
    package = Path(wgmma_forward.__file__).parent.parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            named = getattr(node, "id", None) or getattr(node, "attr", None)
            assert named not in names, path.name


def test_a_forward_family_registered_from_outside_is_chosen_by_its_rule(monkeypatch):
    """A toy forward family, declared as a family module declares one: registered, its rule
    consulted before the mma.sync forward's fallback, its default and feasibility used."""
    import dataclasses
    from typing import ClassVar

    from numflash import config

    monkeypatch.setattr(config, "CONFIG_TYPES", dict(CONFIG_TYPES))
    monkeypatch.setattr(selection, "CONFIG_TYPES", config.CONFIG_TYPES)
    monkeypatch.setattr(selection, "_FORWARD_RULES", dict(selection._FORWARD_RULES))
    monkeypatch.setattr(selection, "_DEFAULTS", dict(selection._DEFAULTS))

    @config.register
    @dataclasses.dataclass(frozen=True)
    class ToyConfig(config._Config):
        block_m: int = config.knob(64, (64,))
        family: ClassVar[str] = "toy-forward"
        ROLE: ClassVar[str] = "forward"
        HARDWARE: ClassVar[str] = "mma.sync"
        REVISION: ClassVar[int] = 1

        def kernel_head_dim(self, head_dim):
            return head_dim

        def problems(self, head_dim, device):
            return []

    selection.default_for(ToyConfig)(lambda head_dim: ToyConfig())
    selection.forward_rule(ToyConfig)(lambda problem, device: problem.head_dim == 40)
    from numflash.validation import Problem

    def problem(head_dim):
        return Problem(1, 128, 128, 2, 2, head_dim, "float16", 0.1, -1, -1)

    assert "toy-forward" in config.CONFIG_TYPES and ToyConfig in families("forward")
    assert selection.forward_family(problem(40), A100) == "toy-forward"
    assert selection.forward(problem(40), A100).config == ToyConfig()
    assert selection.forward_family(problem(64), A100) == "tensor-core"


@pytest.fixture
def no_tuned_entries(tmp_path, monkeypatch):
    """An empty user cache and no shipped files, as long as the test runs."""
    from numflash import cache

    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(cache, "SHIPPED_DIR", tmp_path)
    cache.reload()
    yield
    monkeypatch.undo()
    cache.reload()


@pytest.mark.parametrize(
    "head_dim, seqlen, window, expected",
    [
        # head_dim 64 at most SHORT_BUCKET keys: 128-key tiles, four stages causal
        (64, 1024, (-1, -1), (128, 2)),
        (64, 1000, (-1, 0), (128, 4)),
        (64, 512, (16, 16), (128, 2)),
        # longer: the defaults measured at 4096 and 16384
        (64, 1025, (-1, 0), (192, 2)),
        (64, 4096, (-1, -1), (192, 2)),
        # head_dim 128: the same tiles, pingpong only past SHORT_BUCKET keys
        (128, 1024, (-1, 0), (128, 2)),
        (128, 4096, (-1, 0), (128, 2)),
    ],
)
def test_the_hopper_forward_default_follows_the_seqlen_bucket(
    head_dim, seqlen, window, expected, no_tuned_entries
):
    """A call's default Hopper forward depends on its seqlen bucket and mask where that was
    measured to pay (head_dim 64 at seqlen 1024: wgmma_forward.SHORT_BUCKET), and the tuner
    starts a key's study from the same default (no tuned entry here: an empty user cache and
    no shipped files)."""
    from numflash import cache
    from numflash.families import wgmma_forward
    from numflash.validation import Problem

    p = Problem(2, seqlen, seqlen, 4, 4, head_dim, "float16", 0.1, *window)
    family = wgmma_forward.WgmmaForwardConfig.family
    chosen = selection._tuned_or_default(family, p, H200)[0]
    assert chosen.source == "heuristic"
    assert (chosen.config.block_n, chosen.config.stages) == expected
    key = cache.ProblemKey.of(family, "float16", head_dim, seqlen, seqlen, *window)
    assert selection.default_config(family, head_dim, H200, key=key)[1] == chosen.config
    if head_dim == 128:
        assert chosen.config.pingpong == (seqlen > wgmma_forward.SHORT_BUCKET)
    if head_dim == 64 and expected[0] == 128:
        assert not chosen.config.problems(head_dim, H200)
        assert selection.default_config(family, head_dim, H200)[1].block_n == 192  # no call
