"""`engine.run --num-shards 2` against `--num-shards 1` (the oracle): the same tokens, greedy, teacher-forced
and seeded-sampled, and the same logits, with chunked prefill and the prefix cache on; refusals with exit
status 2; and a group whose rank dies or raises mid-step fails its requests instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.request import FinishReason
from engine.run import EXIT_BAD_INPUT, main
from tests.parallel.test_sharding import copy_checkpoint_with
from tests.core.conftest import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Two shards sum the float64 partials of wo_b and of the MoE in another order than one shard does: equal up to
# float64 rounding before each bf16 rounding, so a logit may differ where a value sits on a rounding boundary.
# 1e-5 is far above such a flip's effect on a logit here and far below what a wrong slice produces (~0.1).
LOGIT_TOL = 1e-5
NUM_NEW = 4


# window 16, chunks of 7 within 24 positions a step; line 4 repeats line 3 (an 80-token prompt fills one
# 64-token block) once line 3 is done, so it starts from a prefix-cache hit
LINES = [
    {"prompt_ids": random_prompt(30, 1)},
    {"prompt_ids": random_prompt(33, 5), "force_ids": [300, 301, 302], "arrival_step": 1},
    {"prompt_ids": random_prompt(80, 7), "max_new_tokens": 2},
    {"prompt_ids": random_prompt(80, 7), "max_new_tokens": 2, "arrival_step": 30},
    {"prompt_ids": random_prompt(21, 9), "max_new_tokens": 3, "temperature": 0.8, "seed": 5, "arrival_step": 2},
]


def run_batch(ckpt: Path, tmp: Path, num_shards: int, capsys) -> tuple[list[dict], Path]:
    batch = tmp / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    dumps = tmp / f"dumps-{num_shards}"
    status = main(["--ckpt", str(ckpt), "--batch", str(batch), "--max-new-tokens", str(NUM_NEW), "--chunk-size", "7",
                   "--max-batch-tokens", "24", "--prefix-cache", "--dump-logits", str(dumps),
                   "--num-shards", str(num_shards)])
    cap = capsys.readouterr()
    assert status == 0, cap.err
    return [json.loads(line) for line in cap.out.splitlines()], dumps


def test_two_shards_give_one_shards_tokens_and_logits(tiny_checkpoint, tmp_path, capsys):
    one, one_dumps = run_batch(tiny_checkpoint, tmp_path, 1, capsys)
    two, two_dumps = run_batch(tiny_checkpoint, tmp_path, 2, capsys)
    assert [r["cached_tokens"] for r in one] == [0, 0, 0, 64, 0]  # the prefix cache took part
    bitwise = []
    for a, b in zip(one, two):
        what = f"line {a['line']}"
        assert b["output_ids"] == a["output_ids"], what
        assert (b["finish_reason"], b["cached_tokens"], b["iterations"]) == \
            (a["finish_reason"], a["cached_tokens"], a["iterations"]), what
        da, db = load_file(one_dumps / f"{a['line']}.safetensors"), load_file(two_dumps / f"{a['line']}.safetensors")
        assert torch.equal(da["input_ids"], db["input_ids"]), what
        computed = ~torch.isnan(da["logits"]).all(-1)
        assert torch.equal(computed, ~torch.isnan(db["logits"]).all(-1)), f"{what}: NaN rows differ"
        assert int(computed.sum()) > 0, what
        diff = (da["logits"][computed] - db["logits"][computed]).abs()
        row, col = divmod(int(diff.argmax()), diff.size(1))
        assert diff.max() <= LOGIT_TOL, f"{what}: max |logit diff| {diff.max():.3g} at computed row {row}, id {col}"
        bitwise.append(torch.equal(da["logits"][computed], db["logits"][computed]))
    assert two[1]["output_ids"] == LINES[1]["force_ids"]
    print(f"logits bitwise equal per line: {bitwise}")


def test_four_shards_are_refused_naming_the_dimension(tiny_checkpoint, capsys):
    status = main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", "5,6,7", "--num-shards", "4"])
    assert status == EXIT_BAD_INPUT
    assert "o_groups=2 is not divisible by 4 shards" in capsys.readouterr().err


def test_missing_tensor_exits_2_naming_tensor_and_rank(tiny_checkpoint, tmp_path, capsys):
    broken = copy_checkpoint_with(tiny_checkpoint, tmp_path / "broken", "layers.4.ffn.experts.5.w1.weight", None)
    status = main(["--ckpt", str(broken), "--prompt-ids", "5,6,7", "--num-shards", "2"])
    err = capsys.readouterr().err
    assert status == EXIT_BAD_INPUT, err
    assert "missing tensor layers.4.ffn.experts.5.w1.weight" in err and " of 2: " in err, err


def start_engine(ckpt: Path, step_timeout: timedelta | None = None) -> LLMEngine:
    return LLMEngine.sharded(ckpt, EngineConfig(runner="golden"), "cpu", 2, step_timeout)


def step_until_done(engine: LLMEngine, limit_s: float) -> list:
    outputs, t0 = [], time.monotonic()
    while engine.has_unfinished:
        outputs += engine.step()
        assert time.monotonic() - t0 < limit_s, "the engine did not finish"
    return outputs


def test_a_rank_that_dies_fails_its_requests_and_later_steps_without_hanging(tiny_checkpoint):
    engine = start_engine(tiny_checkpoint)
    try:
        group = engine.executor
        engine.add_request("a", random_prompt(20, 3), SamplingParams(max_tokens=8))
        first = engine.step()  # the prefill ran on both ranks
        assert first and first[0].new_token_ids and not first[0].finished
        os.kill(group.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = step_until_done(engine, 60)
        assert [(o.request_id, o.finish_reason) for o in out] == [("a", FinishReason.ERROR)]
        assert "rank 1 exited" in out[0].error, out[0].error
        engine.add_request("b", random_prompt(5, 4), SamplingParams(max_tokens=2))
        (later,) = step_until_done(engine, 5)
        assert later.finish_reason == FinishReason.ERROR and "failed earlier" in later.error
        assert time.monotonic() - t0 < 60
    finally:
        engine.close()
    assert not any(p.is_alive() for p in group.procs)


def test_rank_0_raising_mid_step_stops_the_others(tiny_checkpoint, monkeypatch):
    engine = start_engine(tiny_checkpoint)
    try:
        group = engine.executor

        def broken(plan):
            raise RuntimeError("injected on rank 0")

        monkeypatch.setattr(group.runner, "execute", broken)  # the other rank waits in the forward's collectives
        engine.add_request("a", random_prompt(9, 6), SamplingParams(max_tokens=2))
        t0 = time.monotonic()
        (out,) = step_until_done(engine, 30)
        assert out.finish_reason == FinishReason.ERROR and "rank 0 saw RuntimeError: injected on rank 0" in out.error
        assert not any(p.is_alive() for p in group.procs), "rank 1 was not stopped"
        assert time.monotonic() - t0 < 30
    finally:
        engine.close()


def test_a_stalled_rank_fails_the_step_after_the_step_timeout(tiny_checkpoint):
    timeout = 8.0
    engine = start_engine(tiny_checkpoint, timedelta(seconds=timeout))
    try:
        group = engine.executor
        os.kill(group.procs[0].pid, signal.SIGSTOP)  # alive, never answers
        engine.add_request("a", random_prompt(9, 6), SamplingParams(max_tokens=2))
        t0 = time.monotonic()
        (out,) = step_until_done(engine, 60)
        elapsed = time.monotonic() - t0
        assert out.finish_reason == FinishReason.ERROR and "rank 0 saw" in out.error, out.error
        assert timeout <= elapsed < timeout + 20, f"the step failed after {elapsed:.1f} s"
        assert not any(p.is_alive() for p in group.procs), "the stalled rank was not stopped"
    finally:
        engine.close()


def test_exported_blocks_match_and_imported_blocks_reach_every_rank(tiny_checkpoint):
    """Rank 0 answers block reads for the group (the pools are replicated); a block write reaches every rank,
    or the other rank's heads would read empty KV and the imported-prefix run would not match one shard's."""
    prompt, params = random_prompt(80, 11), SamplingParams(max_tokens=3)
    one = LLMEngine.from_checkpoint(tiny_checkpoint, EngineConfig(runner="golden"))
    two = start_engine(tiny_checkpoint)
    try:
        one.add_request("a", prompt, params)
        two.add_request("a", prompt, params)
        assert [o.new_token_ids for o in step_until_done(one, 60)] == [o.new_token_ids for o in step_until_done(two, 60)]
        exported = one.export_prefix(prompt)
        assert exported.data.shape[0] == 1 and (two.export_prefix(prompt).data == exported.data).all()

        fresh_one = LLMEngine.from_checkpoint(tiny_checkpoint, EngineConfig(runner="golden"))
        two.close()
        two = start_engine(tiny_checkpoint)
        results = []
        for engine in (fresh_one, two):
            assert engine.import_prefix(exported) == 64
            engine.add_request("b", prompt, params)
            out = step_until_done(engine, 60)
            results.append(([t for o in out for t in o.new_token_ids], out[-1].stats.num_cached_tokens))
        assert results[1] == results[0] and results[0][1] == 64
    finally:
        two.close()


def test_the_ranks_map_one_shared_copy_of_the_engram_tables_and_print_their_memory(tiny_checkpoint, capfd):
    """Both ranks' Engram tables are the pages of one file in /dev/shm (as each rank's /proc/self/maps names the
    mapping under its tensors), holding exactly the tables' bytes; each rank prints its memory line; the file
    goes with the group. That the tokens are one shard's is test_two_shards_give_one_shards_tokens_and_logits."""
    engine = start_engine(tiny_checkpoint)
    try:
        memory = engine.executor.memory
        [rank0, rank1] = memory
        assert (rank0.rank, rank1.rank) == (0, 1) and rank0.engram_shared and rank1.engram_shared
        assert rank0.engram_file == rank1.engram_file and rank0.engram_inode == rank1.engram_inode, memory
        shared = Path(rank0.engram_file)
        assert shared.parent == Path("/dev/shm") and shared.stat().st_ino == rank0.engram_inode
        assert rank0.engram_bytes == rank1.engram_bytes > 0
        assert rank0.engram_bytes <= shared.stat().st_size < rank0.engram_bytes + 4 * 4096  # one copy, page-aligned
        assert rank0.weights_bytes > 0 and rank0.kv_bytes == engine.executor.kv.nbytes
        err = capfd.readouterr().err
        for m in memory:
            assert m.line() in err, err
        assert "Engram host tables" in rank0.line() and "shared" in rank0.line()
    finally:
        engine.close()
    assert not shared.exists() and not shared.with_name(shared.name + ".lock").exists()
