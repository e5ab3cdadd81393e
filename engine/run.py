"""`python -m engine.run`: run prompts through the engine, like the `run` binary we are measured against.

One prompt prints its generated text on stdout and timing on stderr; `--batch FILE.jsonl` runs one
request per line concurrently through the scheduler and prints one JSON line per request. Malformed
input (or a model the requested shards cannot split) exits with status 2 and a one-line reason; a model
step that failed exits with status 1. `--num-shards N` splits the model over N local processes
(engine/core/shard_group.py). See `--help` for the modes (raw text, token ids, an OpenAI chat request, a
batch, teacher forcing, logit dumps, prompt printing, completion parsing).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.chat import ChatFormatError, is_thinking, parse_completion, render_chat
from engine.checkpoint.loader import CheckpointError
from engine.config import ConfigError
from engine.core.engine import EngineConfig, LLMEngine, RequestError, RequestOutput
from engine.core.engine_config import RUNNER_KINDS, EngineConfigError
from engine.core.shard_group import default_threads
from engine.core.request import FinishReason, RequestStats
from engine.core.sampling_params import SamplingParams

EXIT_BAD_INPUT = 2
EXIT_STEP_FAILED = 1
MAX_TEMPERATURE = 2.0  # SamplingParams' range
BATCH_FIELDS = ("prompt_ids", "force_ids", "max_new_tokens", "temperature", "seed", "arrival_step")
DEFAULTS = EngineConfig()


class UsageError(ValueError):
    """A malformed command line or input file."""


@dataclass(frozen=True, slots=True)
class Job:
    """One prompt to run. Teacher forcing feeds every forced id (the golden CLI's contract: the dump
    has a row after the last one), so the engine generates one token past them, which is dropped;
    max_new_tokens 0 likewise generates one dropped token (the engine always samples at least one)."""

    line: int  # 1-based line of the batch file (1 for a single prompt)
    prompt_ids: list[int]
    force_ids: list[int] | None
    max_new_tokens: int
    temperature: float
    seed: int
    arrival_step: int = 0
    label: str = "the prompt"  # names the job in error messages

    @property
    def num_kept(self) -> int:
        return len(self.force_ids) if self.force_ids is not None else self.max_new_tokens

    @property
    def params(self) -> SamplingParams:
        if self.force_ids is not None:
            return SamplingParams(max_tokens=len(self.force_ids) + 1, temperature=self.temperature, seed=self.seed,
                                  ignore_eos=True)
        return SamplingParams(max_tokens=max(1, self.max_new_tokens), temperature=self.temperature, seed=self.seed)


@dataclass(slots=True)
class Finished:
    job: Job
    output_ids: list[int] = field(default_factory=list)  # everything the engine generated (kept + dropped)
    logit_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, fp32 [rows, V])
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    finish_step: int = 0  # engine.step() calls made when it finished (arrivals count them from 0)
    error: str | None = None  # finish reason "error": what failed

    @property
    def kept_ids(self) -> list[int]:
        return self.output_ids[:self.job.num_kept]

    @property
    def reason(self) -> str:
        return FinishReason.LENGTH.value if len(self.output_ids) > self.job.num_kept else self.finish_reason.value

    @property
    def fed_ids(self) -> list[int]:
        """The ids the decoder was fed: the last generated id never is."""
        return self.job.prompt_ids + self.output_ids[:-1]

    def logits(self, vocab_size: int) -> torch.Tensor:
        """fp32 [len(fed_ids), vocab]: row t = next-token logits after position t; NaN where never computed."""
        out = torch.full((len(self.fed_ids), vocab_size), float("nan"))
        for first, rows in self.logit_rows:
            assert first + rows.size(0) <= out.size(0), f"logit rows {first}..{first + rows.size(0)} past {out.size(0)}"
            out[first:first + rows.size(0)] = rows
        return out


def parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError(f"{flag}: no token ids given")
    return ids


def read_request(path: str) -> dict:
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--request: no such file {path}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--request: {path} is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise UsageError("--request: the body must be a JSON object")
    if "messages" not in body:
        raise UsageError("--request: missing field 'messages'")
    return body


def render_request(body: dict) -> str:
    return render_chat(body["messages"], tools=body.get("tools"), reasoning_effort=body.get("reasoning_effort"))


def read_batch(path: str, args: argparse.Namespace) -> list[Job]:
    """One Job per non-blank line; a missing key takes the CLI flag's value."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise UsageError(f"--batch: no such file {path}") from None
    default_force = parse_ids(args.force_ids, "--force-ids") if args.force_ids else None
    jobs = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"--batch line {n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object")
        unknown = [k for k in obj if k not in BATCH_FIELDS]
        if unknown:
            raise UsageError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(BATCH_FIELDS)})")
        if "prompt_ids" not in obj:
            raise UsageError(f"{where}: missing field 'prompt_ids'")
        force = obj.get("force_ids")
        jobs.append(Job(
            line=n,
            prompt_ids=_id_list(obj["prompt_ids"], f"{where}: prompt_ids"),
            force_ids=default_force if force is None else _id_list(force, f"{where}: force_ids"),
            max_new_tokens=_int_field(obj, "max_new_tokens", args.max_new_tokens, 0, where),
            temperature=_temperature(obj.get("temperature", args.temperature), f"{where}: temperature"),
            seed=_int_field(obj, "seed", args.seed, 0, where),
            arrival_step=_int_field(obj, "arrival_step", 0, 0, where),
            label=where,
        ))
    if not jobs:
        raise UsageError(f"--batch: {path} holds no requests")
    return jobs


def _id_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise UsageError(f"{what}: expected a non-empty list of non-negative integers, got {_short(value)}")
    return value


def _int_field(obj: dict, name: str, default: int, minimum: int, where: str) -> int:
    value = obj.get(name, default)
    if not _is_int(value) or not minimum <= value < 2**63:
        raise UsageError(f"{where}: {name} must be an integer >= {minimum}, got {_short(value)}")
    return value


def _temperature(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TEMPERATURE:
        raise UsageError(f"{what} must be a number in [0, {MAX_TEMPERATURE:g}], got {_short(value)}")
    return float(value)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.run", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="checkpoint folder (config.json, safetensors shards, tokenizer.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text (no chat template, no BOS added)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    src.add_argument("--request",
                     help="an OpenAI chat-completions request body (JSON file), rendered in the V4.1 format")
    src.add_argument("--batch", metavar="FILE.jsonl",
                     help='one request per line: {"prompt_ids": [...], "force_ids": [...], "max_new_tokens": N, '
                          '"temperature": T, "seed": S, "arrival_step": k} (all but prompt_ids optional, defaulting '
                          "to the flags); a line joins when the engine has run k steps; prints one JSON line each")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; else the engine's seeded Gumbel-max sampling (at most 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--runner", choices=RUNNER_KINDS, default=DEFAULTS.runner,
                   help="auto: the kernels on CUDA, the golden float64 modules on CPU; kernels / golden force one")
    p.add_argument("--no-bounded-replay", action="store_true",
                   help="run every layer on every prompt token (reproduces DeepSeek's reference exactly)")
    p.add_argument("--force-ids", help="teacher forcing: decode these ids one step at a time instead of sampling")
    p.add_argument("--dump-logits", metavar="OUT.safetensors|DIR",
                   help="write input_ids [T] and logits [T, vocab] (row t: next-token logits after position t; "
                        "rows never computed, e.g. prompt rows before the replayed window, are NaN); "
                        "with --batch a folder of <line>.safetensors")
    p.add_argument("--prefix-cache", action="store_true", help="keep the prefix cache across the lines of a batch")
    p.add_argument("--chunk-size", type=int, help="cap on one request's prompt positions per step (chunked prefill)")
    p.add_argument("--max-prefill-beside-decode", type=int, metavar="N",
                   help="while a request decodes, the step's prefill chunks take at most N positions together")
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULTS.max_num_batched_tokens,
                   help="positions computed per step, all requests together")
    p.add_argument("--max-seqs", type=int, default=DEFAULTS.max_num_seqs, help="requests running at once")
    p.add_argument("--speculative-tokens", type=int, default=DEFAULTS.speculative_tokens, metavar="K",
                   help="speculative decoding: the checkpoint's DSpark stages draft up to K tokens a step, verified in "
                        "the next target pass (greedy and seeded sampling keep the target's tokens / distribution); "
                        "0 = off, at most the checkpoint's DSpark block (either runner, any --num-shards)")
    p.add_argument("--num-shards", type=int, default=1,
                   help="split the model over N local processes (tensor-parallel attention, expert-parallel MoE; "
                        "gloo on CPU; either runner); N must divide the heads, output groups and experts")
    p.add_argument("--print-prompt", action="store_true", help='print {"prompt", "prompt_token_ids"} as JSON and exit')
    p.add_argument("--parse-completion", metavar="FILE.txt",
                   help="print the parse of a completion (reasoning_content, content, tool_calls) as JSON and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UsageError, RequestError, ChatFormatError, ConfigError, CheckpointError, EngineConfigError,
            FileNotFoundError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return EXIT_BAD_INPUT


def check_args(args: argparse.Namespace) -> None:
    if args.prompt is None and args.prompt_ids is None and args.request is None and args.batch is None:
        raise UsageError("give one of --prompt, --prompt-ids, --request or --batch")
    if args.batch and args.print_prompt:
        raise UsageError("--print-prompt needs --prompt, --prompt-ids or --request, not --batch")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.temperature <= MAX_TEMPERATURE:
        raise UsageError(f"--temperature must be in [0, {MAX_TEMPERATURE:g}], got {args.temperature}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in [0, 2^63), got {args.seed}")
    if args.speculative_tokens < 0:
        raise UsageError(f"--speculative-tokens must be >= 0 (0 = off), got {args.speculative_tokens}")
    for flag, value in (("--chunk-size", args.chunk_size), ("--max-batch-tokens", args.max_batch_tokens),
                        ("--max-seqs", args.max_seqs), ("--num-shards", args.num_shards),
                        ("--max-prefill-beside-decode", args.max_prefill_beside_decode)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(max_num_seqs=args.max_seqs, max_num_batched_tokens=args.max_batch_tokens,
                        max_chunk_tokens=args.chunk_size, bounded_replay=not args.no_bounded_replay,
                        max_prefill_beside_decode=args.max_prefill_beside_decode,
                        enable_prefix_caching=args.prefix_cache, runner=args.runner,
                        speculative_tokens=args.speculative_tokens)


def run(args: argparse.Namespace) -> int:
    body = read_request(args.request) if args.request else None
    if args.parse_completion:
        return print_parse(args.parse_completion, body)
    if not args.ckpt:
        raise UsageError("--ckpt is required")
    check_args(args)
    jobs = read_batch(args.batch, args) if args.batch else None
    force_ids = parse_ids(args.force_ids, "--force-ids") if args.force_ids else None
    prompt_ids = parse_ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None

    if args.num_shards > 1:
        torch.set_num_threads(default_threads(args.num_shards))  # this process is rank 0 of N on this machine
    engine = LLMEngine.from_checkpoint(args.ckpt, engine_config(args), args.device, progress=True,
                                       num_shards=args.num_shards)
    try:
        return run_engine(engine, args, body, jobs, prompt_ids, force_ids)
    finally:
        engine.close()


def run_engine(engine: LLMEngine, args: argparse.Namespace, body: dict | None, jobs: list[Job] | None,
               prompt_ids: list[int] | None, force_ids: list[int] | None) -> int:
    tok, vocab_size = engine.tokenizer, engine.cfg.vocab_size
    if jobs is not None:
        for job in jobs:
            for name, ids in (("prompt_ids", job.prompt_ids), ("force_ids", job.force_ids or [])):
                _check_vocab(ids, vocab_size, f"{job.label}: {name}")
        return run_batch(engine, jobs, args)

    if prompt_ids is not None:
        prompt = tok.decode(prompt_ids)
    else:
        prompt = render_request(body) if body is not None else args.prompt
        prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        raise UsageError("the prompt is empty")
    for flag, ids in (("--prompt-ids", prompt_ids), ("--force-ids", force_ids or [])):
        _check_vocab(ids, vocab_size, flag)
    if args.print_prompt:
        print(json.dumps({"prompt": prompt, "prompt_token_ids": prompt_ids}, ensure_ascii=False))
        return 0
    job = Job(1, prompt_ids, force_ids, args.max_new_tokens, args.temperature, args.seed)
    done = run_jobs(engine, [job], keep_logits=bool(args.dump_logits))[1]
    text = tok.decode(done.kept_ids)
    print(text)
    if body is not None:
        parsed = parse_completion(text, is_thinking(body.get("reasoning_effort")), body.get("tools"))
        print(json.dumps(asdict(parsed), ensure_ascii=False), file=sys.stderr)
    print(request_timing(done) + accept_summary(engine), file=sys.stderr)
    if args.dump_logits:
        save_dump(done, vocab_size, Path(args.dump_logits))
    return exit_status({1: done})


def run_batch(engine: LLMEngine, jobs: list[Job], args: argparse.Namespace) -> int:
    dump_dir = Path(args.dump_logits) if args.dump_logits else None
    if dump_dir is not None:
        if dump_dir.exists() and not dump_dir.is_dir():
            raise UsageError(f"--dump-logits: {dump_dir} is a file; with --batch it names a folder")
        dump_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    done = run_jobs(engine, jobs, keep_logits=dump_dir is not None)
    wall = time.perf_counter() - t0
    for job in jobs:
        d = done[job.line]
        print(json.dumps({"line": job.line, "output_ids": d.kept_ids, "text": engine.tokenizer.decode(d.kept_ids),
                          "finish_reason": d.reason, "prompt_tokens": len(job.prompt_ids),
                          "cached_tokens": d.stats.num_cached_tokens, "iterations": d.stats.num_iterations,
                          "finish_step": d.finish_step},
                         ensure_ascii=False))
        if dump_dir is not None:
            save_dump(d, engine.cfg.vocab_size, dump_dir / f"{job.line}.safetensors")
    s = engine.stats
    generated = sum(len(d.kept_ids) for d in done.values())
    ms_per_step = 1000 * s.busy_time / max(1, s.num_steps)
    print(f"batch: {len(jobs)} requests, {s.num_steps} steps, {s.num_computed_tokens} positions computed, "
          f"{generated} tokens kept; wall {wall:.2f} s ({generated / wall:.1f} tok/s, "
          f"{s.num_computed_tokens / wall:.1f} positions/s); busy {ms_per_step:.2f} ms/step; "
          f"{s.num_preemptions} preemptions; prefix cache hit rate {engine.cache.hit_rate:.1%}{accept_summary(engine)}",
          file=sys.stderr)
    return exit_status(done)


def exit_status(done: dict[int, Finished]) -> int:
    """0, or EXIT_STEP_FAILED with each failed request's reason on stderr."""
    failed = [d for d in done.values() if d.error is not None]
    for d in failed:
        print(f"error: {d.job.label}: {d.error}", file=sys.stderr)
    return EXIT_STEP_FAILED if failed else 0


def run_jobs(engine: LLMEngine, jobs: list[Job], keep_logits: bool) -> dict[int, Finished]:
    """Step the engine until every job finished. A job joins before the step whose index (0-based, counting
    every engine.step() call) equals its arrival_step; an idle engine skips ahead to the next arrival."""
    arrivals = deque(sorted(jobs, key=lambda j: j.arrival_step))  # stable: ties keep input order
    done = {job.line: Finished(job) for job in jobs}
    by_id: dict[str, Finished] = {}
    num_steps = 0
    while arrivals or engine.has_unfinished:
        if not engine.has_unfinished:
            num_steps = max(num_steps, arrivals[0].arrival_step)
        while arrivals and arrivals[0].arrival_step <= num_steps:
            job = arrivals.popleft()
            request_id = f"line-{job.line}"
            try:
                engine.add_request(request_id, job.prompt_ids, job.params, job.force_ids, keep_logits=keep_logits)
            except RequestError as e:
                raise UsageError(f"{job.label}: {e}") from None
            by_id[request_id] = done[job.line]
        outputs = engine.step()
        num_steps += 1
        for out in outputs:
            collect(by_id[out.request_id], out, num_steps)
    return done


def collect(d: Finished, out: RequestOutput, num_steps: int) -> None:
    d.output_ids += out.new_token_ids
    if out.logits is not None:
        d.logit_rows.append(out.logits)
    if out.finished:
        d.finish_reason, d.stats, d.finish_step, d.error = out.finish_reason, out.stats, num_steps, out.error


def save_dump(d: Finished, vocab_size: int, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"input_ids": torch.tensor(d.fed_ids, dtype=torch.int64), "logits": d.logits(vocab_size)}, path)


def request_timing(d: Finished) -> str:
    s = d.stats
    prompt_len, decode_steps = len(d.job.prompt_ids), len(d.fed_ids) - len(d.job.prompt_ids)
    prefill = prompt_len / s.prefill_time if s.prefill_time else math.nan
    decode = 1000 * s.decode_time / decode_steps if decode_steps else math.nan
    return (f"prompt {prompt_len} tokens, prefill {s.prefill_time * 1000:.1f} ms ({prefill:.1f} tok/s); "
            f"decode {decode_steps} steps, {decode:.2f} ms/token")


def accept_summary(engine: LLMEngine) -> str:
    """'; accept A tokens/step (a of d drafts)' with speculative decoding on, else ''."""
    s = engine.stats
    if not engine.config.is_speculative:
        return ""
    return (f"; accept {s.accept_length:.2f} tokens/step ({s.num_accepted_tokens} of {s.num_draft_tokens} drafts "
            f"in {s.num_verify_steps} verify steps)")


def _check_vocab(ids: list[int], vocab_size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"{what}: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def print_parse(path: str, body: dict | None) -> int:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UsageError(f"--parse-completion: no such file {path}") from None
    thinking = is_thinking(body.get("reasoning_effort")) if body is not None else True
    parsed = parse_completion(text, thinking, body.get("tools") if body is not None else None)
    print(json.dumps(asdict(parsed), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
