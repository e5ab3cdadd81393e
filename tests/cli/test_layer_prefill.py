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
