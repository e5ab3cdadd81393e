"""`python -m engine.run`: run the golden model on one prompt, like the `run` binary we are measured against.

Prints the generated text on stdout and timing on stderr. Malformed input exits with status 2 and a
one-line reason. See `--help` for the modes (raw text, token ids, an OpenAI chat request, teacher
forcing, logit dumps, prompt printing, completion parsing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine.chat import ChatFormatError, is_thinking, parse_completion, render_chat
from engine.checkpoint.loader import CheckpointError
from engine.config import ConfigError

EXIT_BAD_INPUT = 2


class UsageError(ValueError):
    """A malformed command line or input file."""


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.run", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="checkpoint folder (config.json, safetensors shards, tokenizer.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text (no chat template, no BOS added)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    src.add_argument("--request", help="an OpenAI chat-completions request body (JSON file), rendered in the V4.1 format")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else the reference's Gumbel-max sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-bounded-replay", action="store_true",
                   help="run every layer on every prompt token (reproduces DeepSeek's reference exactly)")
    p.add_argument("--force-ids", help="teacher forcing: decode these ids one step at a time instead of sampling")
    p.add_argument("--dump-logits", metavar="OUT.safetensors",
                   help="write input_ids [T] and logits [T, vocab] (row t: next-token logits after position t; "
                        "with bounded replay on, prompt rows before the replayed window are NaN)")
    p.add_argument("--print-prompt", action="store_true", help='print {"prompt", "prompt_token_ids"} as JSON and exit')
    p.add_argument("--parse-completion", metavar="FILE.txt",
                   help="print the parse of a completion (reasoning_content, content, tool_calls) as JSON and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UsageError, ChatFormatError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    body = read_request(args.request) if args.request else None
    if args.parse_completion:
        return print_parse(args.parse_completion, body)
    if not args.ckpt:
        raise UsageError("--ckpt is required")
    if args.prompt is None and args.prompt_ids is None and body is None:
        raise UsageError("give one of --prompt, --prompt-ids or --request")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    force_ids = parse_ids(args.force_ids, "--force-ids") if args.force_ids else None

    from engine.load import load_model  # after argument checks: loading imports the model stack

    loaded = load_model(args.ckpt, args.device, with_mtp=False)
    tok, cfg = loaded.tokenizer, loaded.cfg
    if args.prompt_ids is not None:
        prompt_ids = parse_ids(args.prompt_ids, "--prompt-ids")
        prompt = tok.decode(prompt_ids)
    else:
        prompt = render_request(body) if body is not None else args.prompt
        prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        raise UsageError("the prompt is empty")
    for flag, ids in (("--prompt-ids", prompt_ids), ("--force-ids", force_ids or [])):
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise UsageError(f"{flag}: ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    if args.print_prompt:
        print(json.dumps({"prompt": prompt, "prompt_token_ids": prompt_ids}, ensure_ascii=False))
        return 0
    result = generate(loaded.model, prompt_ids, force_ids, args, eos_id=tok.eos_id)
    text = tok.decode(result.new_ids)
    print(text)
    if body is not None:
        parsed = parse_completion(text, is_thinking(body.get("reasoning_effort")), body.get("tools"))
        print(json.dumps(asdict(parsed), ensure_ascii=False), file=sys.stderr)
    print(result.timing(), file=sys.stderr)
    if args.dump_logits:
        from safetensors.torch import save_file

        save_file({"input_ids": torch.tensor(result.fed_ids, dtype=torch.int64),
                   "logits": torch.cat(result.logit_rows).float().contiguous()}, args.dump_logits)
    return 0


class Generation:
    def __init__(self) -> None:
        self.new_ids: list[int] = []
        self.fed_ids: list[int] = []
        self.logit_rows: list[torch.Tensor] = []
        self.prefill_s = self.decode_s = 0.0
        self.prompt_len = self.decode_steps = 0

    def timing(self) -> str:
        prefill = self.prompt_len / self.prefill_s if self.prefill_s else float("nan")
        decode = 1000 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")
        return (f"prompt {self.prompt_len} tokens, prefill {self.prefill_s * 1000:.1f} ms ({prefill:.1f} tok/s); "
                f"decode {self.decode_steps} steps, {decode:.2f} ms/token")


def generate(model, prompt_ids: list[int], force_ids: list[int] | None, args: argparse.Namespace,
             eos_id: int) -> Generation:
    """Prefill the prompt, then one-token decode steps: sampled, or teacher-forced with force_ids."""
    from engine.model.dspark import sample

    device = model.embed.weight.device
    replay = not args.no_bounded_replay
    dump = bool(args.dump_logits)
    steps = len(force_ids) if force_ids is not None else args.max_new_tokens
    cache = model.new_cache(1, len(prompt_ids) + steps + 1, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    g = Generation()
    g.prompt_len, g.fed_ids = len(prompt_ids), list(prompt_ids)

    t0 = time.perf_counter()
    out = model(torch.tensor([prompt_ids], device=device), 0, cache, bounded_replay=replay, full_logits=dump)
    if dump:
        missing = out.first_pos  # rows before the replayed window were never computed
        g.logit_rows.append(torch.full((missing, out.logits.size(-1)), float("nan")))
        g.logit_rows.append(out.logits[0].cpu())
    last = out.logits[0, -1] if dump else out.logits[0]
    _sync(device)
    g.prefill_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for step in range(steps):
        nxt = force_ids[step] if force_ids is not None else int(sample(last[None], args.temperature, gen)[0])
        g.new_ids.append(nxt)
        if force_ids is None and (nxt == eos_id or step == steps - 1):
            break  # a sampled token that ends generation is not fed
        out = model(torch.tensor([[nxt]], device=device), cache.seq_len, cache, full_logits=dump)
        g.fed_ids.append(nxt)
        g.decode_steps += 1
        last = out.logits[0, -1] if dump else out.logits[0]
        if dump:
            g.logit_rows.append(out.logits[0].cpu())
    _sync(device)
    g.decode_s = time.perf_counter() - t0
    return g


def print_parse(path: str, body: dict | None) -> int:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UsageError(f"--parse-completion: no such file {path}") from None
    thinking = is_thinking(body.get("reasoning_effort")) if body is not None else True
    parsed = parse_completion(text, thinking, body.get("tools") if body is not None else None)
    print(json.dumps(asdict(parsed), ensure_ascii=False))
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
