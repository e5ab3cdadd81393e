"""`python -m engine.run`: determinism, prefill-vs-decode agreement of dumped logits, the engine's dump
against the golden model, seeded sampling, prompts, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.load import load_model
from engine.presets import tiny_config
from engine.run import main

PROMPT = [0, 128803, 791, 3625, 11, 1002, 4571, 304, 2204, 5, 17, 400, 9001, 12, 13, 14, 15, 16, 17, 18, 19, 20,
          21, 22, 23, 24, 25]  # 27 ids: longer than the tiny window (16), so ratio-2 groups and top-k all engage
FORCED = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310]
# Prefill and one-token decode run the same per-row arithmetic in the golden model (deterministic
# top-k ties, float64 products rounded once), so rows agree bitwise on this machine; 1e-6 of the
# largest logit leaves room for another CPU's vector kernels and is far below what a real bug produces.
REL_TOL = 1e-6
# The engine runs the golden layers over a flat stream of positions, so its logits rows should be the
# golden model's bit for bit (they were on the 2-core CPU these tests were written on); 1e-5 is the
# asserted bound, since a float64 summation-order change could flip one bf16 rounding.
GOLDEN_TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the tiny preset, seed 0


@dataclass(frozen=True)
class GoldenRun:
    new_ids: list[int]  # generated (greedy) or forced ids
    fed_ids: list[int]  # prompt + every id fed back (the last generated id is not)
    logits: torch.Tensor  # fp32 [len(fed_ids), vocab]; NaN rows where the decoder never ran (bounded replay)


def golden_run(model, prompt: list[int], num_new: int, replay: bool, eos_id: int,
               force_ids: list[int] | None = None) -> GoldenRun:
    """The golden model alone, as the CLI used to run it: prefill with full logits, then one-token
    decode steps; greedy until EOS or num_new tokens, or feeding every forced id."""
    cache = model.new_cache(1, len(prompt) + num_new + len(force_ids or []) + 1)
    out = model(torch.tensor([prompt]), 0, cache, bounded_replay=replay, full_logits=True)
    rows = [torch.full((out.first_pos, out.logits.size(-1)), math.nan), out.logits[0]]
    fed, new = list(prompt), []
    while True:
        new.append(force_ids[len(new)] if force_ids else int(rows[-1][-1].argmax()))
        if force_ids is None and (new[-1] == eos_id or len(new) == num_new):
            break
        out = model(torch.tensor([[new[-1]]]), cache.seq_len, cache, full_logits=True)
        fed.append(new[-1])
        rows.append(out.logits[0])
        if force_ids is not None and len(new) == len(force_ids):
            break
    return GoldenRun(new, fed, torch.cat(rows))


def compare_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> bool:
    """Same shape, NaN rows exactly where the golden rows are NaN, computed rows within GOLDEN_TOL.
    Returns whether the computed rows are bitwise equal."""
    assert got.shape == want.shape and got.dtype == torch.float32, f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}"
    nan_rows = torch.isnan(want).all(-1)
    assert torch.equal(torch.isnan(got).all(-1), nan_rows), f"{what}: NaN rows differ"
    assert torch.isfinite(got[~nan_rows]).all(), f"{what}: non-finite values in computed rows"
    diff = (got[~nan_rows] - want[~nan_rows]).abs()
    worst = int(diff.max(-1).values.argmax())
    assert diff.max() <= GOLDEN_TOL, f"{what}: max |logit diff| {diff.max():.3g} in computed row {worst}"
    return torch.equal(got[~nan_rows], want[~nan_rows])


@pytest.fixture(scope="module")
def golden(tiny_checkpoint):
    return load_model(tiny_checkpoint, with_mtp=False, progress=False)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.run", *args], capture_output=True, text=True, timeout=300)


def dump(ckpt: Path, out: Path, prompt: list[int], forced: list[int]) -> dict[str, torch.Tensor]:
    r = run_cli("--ckpt", str(ckpt), "--prompt-ids", ",".join(map(str, prompt)), "--force-ids",
                ",".join(map(str, forced)), "--no-bounded-replay", "--dump-logits", str(out))
    assert r.returncode == 0, r.stderr
    return load_file(out)


def test_dump_logits_deterministic_across_processes_and_prefill_equals_decode(ckpt, tmp_path):
    a = dump(ckpt, tmp_path / "a.safetensors", PROMPT, FORCED)
    b = dump(ckpt, tmp_path / "b.safetensors", PROMPT, FORCED)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    T = len(PROMPT) + len(FORCED)
    assert a["input_ids"].tolist() == PROMPT + FORCED
    assert a["logits"].shape == (T, tiny_config().vocab_size) and a["logits"].dtype == torch.float32
    assert torch.isfinite(a["logits"]).all()
    # the same positions scored by one prefill (c: everything is prompt) vs step-by-step decode (a)
    c = dump(ckpt, tmp_path / "c.safetensors", PROMPT + FORCED, [400])
    n = len(PROMPT)
    decode_rows, prefill_rows = a["logits"][n:], c["logits"][n:T]
    scale = prefill_rows.abs().max()
    err = (decode_rows - prefill_rows).abs().max()
    assert err <= REL_TOL * scale, f"decode vs prefill logits differ by {err} (max |logit| {scale})"
    assert torch.equal(decode_rows.argmax(-1), prefill_rows.argmax(-1))
    assert (a["logits"][:n] - c["logits"][:n]).abs().max() <= REL_TOL * scale  # prompt rows of two prefill lengths


def test_bounded_replay_dump_marks_uncomputed_prompt_rows(ckpt, tmp_path):
    out = tmp_path / "r.safetensors"
    r = run_cli("--ckpt", str(ckpt), "--prompt-ids", ",".join(map(str, PROMPT)), "--force-ids", "5,6",
                "--dump-logits", str(out))
    assert r.returncode == 0, r.stderr
    logits = load_file(out)["logits"]
    window = tiny_config().window_size
    replay_start = len(PROMPT) - window
    assert torch.isnan(logits[:replay_start]).all()
    assert torch.isfinite(logits[replay_start:]).all()


def test_generates_text_and_timing(ckpt):
    r = run_cli("--ckpt", str(ckpt), "--prompt", "Once upon a time", "--max-new-tokens", "8", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "ms/token" in r.stderr


def test_print_prompt_renders_chat_request(ckpt, tmp_path, capsys):
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none"}))
    assert main(["--ckpt", str(ckpt), "--request", str(req), "--print-prompt"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["prompt"] == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert shown["prompt_token_ids"][0] == 0 and shown["prompt_token_ids"][-1] == 128822  # BOS ... </think>
    assert 128803 in shown["prompt_token_ids"] and 128804 in shown["prompt_token_ids"]


def test_parse_completion(tmp_path, capsys):
    text = tmp_path / "c.txt"
    text.write_text("plan it</think>Done.<｜end▁of▁sentence｜>")
    assert main(["--parse-completion", str(text)]) == 0
    assert json.loads(capsys.readouterr().out) == {"reasoning_content": "plan it", "content": "Done.", "tool_calls": []}


@pytest.mark.parametrize("argv, needle", [
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "1,999999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--force-ids", "-3"], "--force-ids"),
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--prompt", "hi", "--temperature", "2.5"], "--temperature"),
    (["--prompt", "hi", "--seed", "-1"], "--seed"),
    (["--prompt", "hi", "--chunk-size", "0"], "--chunk-size"),
    (["--prompt", "hi", "--max-prefill-beside-decode", "0"], "--max-prefill-beside-decode must be >= 1"),
    (["--prompt", "hi", "--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["--prompt", "hi", "--max-seqs", "-2"], "--max-seqs"),
    (["--batch", "b.jsonl", "--print-prompt"], "--print-prompt"),
    ([], "give one of"),
    (["--prompt", "hi", "--speculative-tokens", "-1"], "--speculative-tokens must be >= 0"),
    (["--prompt", "hi", "--speculative-tokens", "4"], "past the checkpoint's DSpark block of 3 tokens"),
    (["--prompt", "hi", "--speculative-tokens", "4", "--runner", "kernels", "--num-shards", "2"],
     "past the checkpoint's DSpark block of 3 tokens"),  # before any rank starts
])
def test_malformed_input_exits_2_with_reason(ckpt, capsys, argv, needle):
    assert main(["--ckpt", str(ckpt), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err


def test_bad_request_and_missing_checkpoint(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["--ckpt", str(tmp_path), "--request", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["--ckpt", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("replay", [True, False], ids=["replay-on", "replay-off"])
def test_engine_text_and_dump_equal_golden_model(tiny_checkpoint, golden, tmp_path, capsys, replay):
    """The CLI now runs the engine: its greedy text and its teacher-forced dump are the golden model's."""
    eos, prompt = golden.tokenizer.eos_id, ",".join(map(str, PROMPT))
    flags = [] if replay else ["--no-bounded-replay"]
    forced = golden_run(golden.model, PROMPT, 0, replay, eos, force_ids=FORCED[:4])
    out = tmp_path / "d.safetensors"
    assert main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", prompt, "--force-ids", ",".join(map(str, FORCED[:4])),
                 "--dump-logits", str(out), *flags]) == 0
    assert capsys.readouterr().out == golden.tokenizer.decode(FORCED[:4]) + "\n"
    dumped = load_file(out)
    assert dumped["input_ids"].tolist() == forced.fed_ids == PROMPT + FORCED[:4]
    compare_logits(dumped["logits"], forced.logits, "teacher-forced dump")

    greedy = golden_run(golden.model, PROMPT, 5, replay, eos)
    assert main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", prompt, "--max-new-tokens", "5", *flags]) == 0
    cap = capsys.readouterr()
    assert cap.out == golden.tokenizer.decode(greedy.new_ids) + "\n"
    assert "tok/s" in cap.err and "ms/token" in cap.err


@pytest.mark.usefixtures("one_torch_thread")
def test_seeded_sampling_is_reproducible_and_zero_tokens_dump_the_prompt(tiny_checkpoint, golden, tmp_path, capsys):
    def sampled(seed: str) -> str:
        assert main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "3",
                     "--temperature", "1.0", "--seed", seed]) == 0
        return capsys.readouterr().out

    assert sampled("11") == sampled("11") != sampled("12")
    out = tmp_path / "zero.safetensors"
    assert main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "0",
                 "--dump-logits", str(out)]) == 0
    assert capsys.readouterr().out == "\n"
    dumped = load_file(out)
    assert dumped["input_ids"].tolist() == [5, 6, 7, 8]
    compare_logits(dumped["logits"], golden_run(golden.model, [5, 6, 7, 8], 1, True, -1).logits, "prompt-only dump")


@pytest.mark.usefixtures("one_torch_thread")
def test_speculative_tokens_keep_the_text_the_dump_and_report_accept(tiny_checkpoint, tmp_path, capsys):
    """--speculative-tokens K: greedy text and a teacher-forced dump equal K = 0's; the summary lines say 'accept'."""
    prompt, forced = ",".join(map(str, PROMPT)), ",".join(map(str, FORCED[:5]))
    runs = {}
    for k in ("0", "3"):
        dump_path = tmp_path / f"forced-{k}.safetensors"
        assert main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", prompt, "--force-ids", forced, "--dump-logits",
                     str(dump_path), "--speculative-tokens", k]) == 0
        capsys.readouterr()
        assert main(["--ckpt", str(tiny_checkpoint), "--prompt-ids", prompt, "--max-new-tokens", "6",
                     "--speculative-tokens", k]) == 0
        cap = capsys.readouterr()
        runs[k] = (cap.out, load_file(dump_path))
        assert ("accept" in cap.err) == (k != "0") and "ms/token" in cap.err
    assert runs["3"][0] == runs["0"][0]
    assert torch.equal(runs["3"][1]["input_ids"], runs["0"][1]["input_ids"])
    assert compare_logits(runs["3"][1]["logits"], runs["0"][1]["logits"], "forced dump, K = 3 vs 0")

    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"prompt_ids": PROMPT[:9], "max_new_tokens": 4}) + "\n"
                     + json.dumps({"prompt_ids": PROMPT[3:], "max_new_tokens": 5, "temperature": 1.0}) + "\n")
    assert main(["--ckpt", str(tiny_checkpoint), "--batch", str(batch), "--speculative-tokens", "2"]) == 0
    cap = capsys.readouterr()
    lines = [json.loads(line) for line in cap.out.splitlines()]
    assert [len(line["output_ids"]) for line in lines] == [4, 5]
    assert "accept " in cap.err and "tokens/step" in cap.err and "drafts" in cap.err
