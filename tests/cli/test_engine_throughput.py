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
    assert "| 3 |" in table and "per GPU, 40 layers on 8 GPUs (x 10/40)" in table
