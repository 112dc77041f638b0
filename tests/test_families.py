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
