"""`--gpu-fraction f`: each replica's shard actor asks Ray for f of a GPU, so that 1 / f replicas share one GPU
(two on one H200 at 0.5). Checked on the CPU: the settings' validation, the shard actor's options and the replica's
placement-group bundles (nothing is started; whether two replicas then run on one H200 is a GPU measurement)."""

from __future__ import annotations

import pytest

from serve_app.engine_replica import deployment
from serve_app.settings import ServeSettings, SettingsError
from serve_app.shard_worker import shard_actor_options


def settings(**kw) -> ServeSettings:
    return ServeSettings(checkpoint="/nonexistent", **kw)  # one shard: the checkpoint is not read


def test_the_flag_and_the_env_free_mapping_parse_a_fraction():
    assert ServeSettings.from_cli(["--checkpoint", "/x", "--device", "cuda", "--gpu-fraction", "0.5"]).gpu_fraction == 0.5
    assert ServeSettings.from_mapping({"checkpoint": "/x", "device": "cuda", "gpu_fraction": "0.25"}, {}).gpu_fraction == 0.25
    assert settings().gpu_fraction == 1.0


@pytest.mark.parametrize("value, message", [
    (0.0, r"--gpu-fraction must be a number in \(0, 1\], got 0.0"),
    (-0.5, r"--gpu-fraction must be a number in \(0, 1\]"),
    (1.5, r"--gpu-fraction must be a number in \(0, 1\]"),
    (True, r"--gpu-fraction must be a number in \(0, 1\]"),
    ("0.5", r"--gpu-fraction must be a number in \(0, 1\]"),
])
def test_a_fraction_outside_0_to_1_is_refused(value, message):
    with pytest.raises(SettingsError, match=message):
        settings(device="cuda", gpu_fraction=value)
    with pytest.raises(SettingsError, match="--gpu-fraction: expected a number"):
        ServeSettings.from_cli(["--checkpoint", "/x", "--device", "cuda", "--gpu-fraction", "half"])
    with pytest.raises(SettingsError, match="expected a finite number"):
        ServeSettings.from_cli(["--checkpoint", "/x", "--device", "cuda", "--gpu-fraction", "nan"])


def test_a_fraction_is_refused_on_the_cpu_and_with_several_shards():
    with pytest.raises(SettingsError, match="--gpu-fraction 0.5 with --device cpu: a fraction of a GPU applies to "
                                            "--device cuda only"):
        settings(device="cpu", gpu_fraction=0.5)
    with pytest.raises(SettingsError, match="--gpu-fraction 0.5 with --num-shards 2: a sharded replica takes whole GPUs"):
        settings(device="cuda", gpu_fraction=0.5, num_shards=2, runner="golden")
    settings(device="cpu", gpu_fraction=1.0)  # the default is fine anywhere


@pytest.mark.parametrize("fraction", [0.5, 0.25, 1.0])
def test_the_shard_actor_and_the_placement_bundles_ask_for_the_fraction(fraction):
    s = settings(device="cuda", gpu_fraction=fraction, replica_num_cpus=0.5, num_replicas=2)
    options = shard_actor_options(s)
    assert (options["num_gpus"], options["num_cpus"]) == (fraction, 1.0)
    d = deployment(s)
    assert d._deployment_config.num_replicas == 2
    assert d._replica_config.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 1.0, "GPU": fraction}]
    assert d._replica_config.placement_group_strategy == "STRICT_PACK"
    cpu = settings(device="cpu")
    assert shard_actor_options(cpu)["num_gpus"] == 0.0
    assert deployment(cpu)._replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
