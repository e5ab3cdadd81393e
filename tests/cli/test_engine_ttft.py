"""benchmarks/engine_ttft.py on the CPU (tiny model, whole and rank 0 of 2): a TTFT per length, and the projection
to the released model on 8 GPUs scaled by the model's share."""

import pytest

from benchmarks import engine_ttft


@pytest.mark.parametrize("shards,share", [(1, 10 / 40), (2, 10 / 40 / 2)])
def test_ttft_rows_and_their_projection(capsys, shards, share):
    rows = engine_ttft.main(["--model", "tiny", "--shards", str(shards), "--lengths", "40,70", "--chunk", "32",
                             "--runs", "1", "--cache-mib", "64"])
    assert [n for n, _ in rows] == [40, 70] and all(s > 0 for _, s in rows)
    table = capsys.readouterr().out.splitlines()
    for n, s in rows:
        row = next(line for line in table if line.startswith(f"| {n} |"))
        assert row.split("|")[-2].strip() == f"{s * 1e3 / (8 * share):,.0f}"
