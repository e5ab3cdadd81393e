"""benchmarks/layer_prefill.py on the CPU: every layer of a tiny model's prefill is timed, and the released
config's projection adds up the measured kinds layer by layer."""

from benchmarks import layer_prefill
from engine.presets import full_config, tiny_config


def test_every_layer_is_timed_and_grouped_by_kind(capsys):
    by_length = layer_prefill.main(["--model", "tiny", "--lengths", "100", "--chunk", "64", "--cache-mib", "64"])
    cfg = tiny_config()
    measured = by_length[100]
    assert set(measured) == {layer_prefill.kind(r) for r in cfg.roles[:cfg.n_layers]}
    assert all(s > 0 for s in measured.values())
    out = capsys.readouterr().out
    assert all(f"| {i} |" in out for i in range(cfg.n_layers)), "a layer's row is missing"


def test_the_released_projection_costs_each_layer_as_its_kind():
    cfg = full_config()
    kinds = [layer_prefill.kind(r) for r in cfg.roles[:cfg.n_layers]]
    assert len(kinds) == 40
    ones = {k: 1.0 for k in kinds}
    assert layer_prefill.released_projection(ones) == (40.0, [])
    dropped = kinds[0]
    total, missing = layer_prefill.released_projection({k: v for k, v in ones.items() if k != dropped})
    assert total == 40 - kinds.count(dropped) and missing == [layer_prefill.kind_text(dropped)]


def test_the_profiled_chunk_puts_each_layers_ops_under_that_layer(capsys):
    layer_prefill.main(["--model", "tiny", "--lengths", "100", "--chunk", "64", "--cache-mib", "64",
                        "--profile-kernels", "3", "--runs", "2"])
    out = capsys.readouterr().out
    report = out[out.index("under the profiler"):]
    cfg = tiny_config()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    assert [int(r.split("|")[1]) for r in rows] == list(range(cfg.n_layers)), report  # none outside a layer
    window, ops = (float(rows[0].split("|")[k]) for k in (3, 4))
    assert 0 < ops <= window, report  # a layer's ops lie inside its window


def test_leaves_fall_in_the_window_where_they_start():
    windows = [(0, 0.0, 10.0), (1, 10.0, 25.0)]
    leaves = [layer_prefill.Leaf("a", 1, 4), layer_prefill.Leaf("a", 5, 7), layer_prefill.Leaf("b", 10, 20),
              layer_prefill.Leaf("c", 30, 31)]
    per = layer_prefill.leaves_by_layer(windows, leaves)
    assert per == {0: {"a": 5.0}, 1: {"b": 10.0}, -1: {"c": 1.0}}
