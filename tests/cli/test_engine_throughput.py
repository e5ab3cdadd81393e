"""benchmarks/engine_throughput.py on the CPU (tiny model): every request gets its tokens, and the run's counts
and times are consistent."""

from benchmarks import engine_throughput


def test_a_small_run_accounts_for_every_token(capsys):
    runs = engine_throughput.main(["--model", "tiny", "--concurrency", "1,3", "--prompt-len", "40", "--output-len",
                                   "5", "--chunk", "64", "--cache-mib", "64"])
    assert [r.concurrency for r in runs] == [1, 3]
    for r in runs:
        assert r.output_tokens == 5 * r.concurrency, "every request drew its 5 tokens"
        assert len(r.ttft_s) == r.concurrency and (r.ttft_s > 0).all() and r.ttft_s.max() <= r.wall_s
        assert 0 < r.decode_tokens < r.output_tokens and 0 < r.decode_s < r.wall_s and r.decode_steps > 0
    table = capsys.readouterr().out
    assert "| 3 |" in table and "per GPU, the released model on 8 GPUs (x 0.25) |" in table  # 10 of 40 layers


def test_rank_0_of_2_is_one_gpu_of_its_group(capsys):
    """--shards 2: rank 0 of the tiny model split two ways, solo; a GPU's share is 10 / 40 / 2 of the rank's rate."""
    runs = engine_throughput.main(["--model", "tiny", "--shards", "2", "--concurrency", "2", "--prompt-len", "24",
                                   "--output-len", "3", "--chunk", "64", "--cache-mib", "64"])
    (r,) = runs
    assert r.output_tokens == 6
    out = capsys.readouterr().out
    assert "rank 0 of 2 (solo) of 10 tiny layers" in out and "(x 0.125) |" in out
    row = next(line for line in out.splitlines() if line.startswith("| 2 |"))
    assert row.split("|")[-2].strip() == f"{r.output_tok_s * 10 / 40 / 2:,.0f}"
