"""benchmarks/prefill_meta.py on the CPU: it times the chunk metadata of every compression ratio of the released
config."""

from benchmarks import prefill_meta
from engine.presets import full_config


def test_every_ratio_is_timed():
    cfg = full_config()
    times = prefill_meta.main(["--chunk", "256", "--context", "1024", "--device", "cpu", "--reps", "1"])
    assert set(times) == {r.ratio for r in cfg.roles[:cfg.n_layers]} and all(ms > 0 for ms in times.values())
