"""llguidance vs xgrammar on V4.1's 129,280-token vocabulary, on this machine's CPU: what choosing the structured-output
library for engine/core/grammar.py rests on (results in benchmarks/RESULTS.md).

For each library: the tokenizer's preparation (llguidance's as the engine makes it, with its token slices:
engine/core/grammar.py's `llg_tokenizer`), each grammar's compile time, and the per-token cost of computing the
next-token bitmask while following a valid output token by token (mean and p99 over every step), for one request
(batch 1) and for 64 requests at once (batch 64: all masks of a step, in parallel where the library can; reported
per step and per request). The grammars: the JSON schema of the API tests (enums, booleans, a nested object, a
bounded array), a wider schema (12 mixed properties, strings with lengths and a pattern), and json_object.
llguidance also compiles the DSML tool-call grammar (engine/chat/constraints.py), which xgrammar would express as
a structural tag (not measured), and the grammar of tool_choice auto with a strict tool, followed through reasoning,
`</think>`, content and a calls block (a free tool's call, then the strict tool's), at batch 1 and 64.

    python benchmarks/grammar_masks.py [--repeat 3] [--runs 5]   # xgrammar optional: pip install xgrammar to include it
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from engine.chat import syntax
from engine.chat.constraints import JSON_OPTIONS, auto_tools_grammar, json_grammar, tool_calls_grammar
from engine.core.grammar import llg_tokenizer
from engine.tokenizer import Tokenizer, load_tokenizer, write_tokenizer_files

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "unit": {"enum": ["cm", "in"]}},
                 "required": ["w", "unit"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
    "required": ["ok", "color", "size", "tags"], "additionalProperties": False,
}
INSTANCE = {"ok": True, "color": "green", "size": {"w": 42, "unit": "cm"}, "tags": [True, False]}
WIDE = {
    "type": "object",
    "properties": {**{f"s{i}": {"type": "string", "maxLength": 40} for i in range(4)},
                   **{f"n{i}": {"type": "number"} for i in range(3)},
                   "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                   "when": {"type": "string", "format": "date"},
                   "items": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"},
                             "v": {"type": "integer"}}, "required": ["k", "v"], "additionalProperties": False},
                             "maxItems": 4},
                   "flag": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c", "d"]}},
    "required": ["s0", "s1", "s2", "s3", "n0", "n1", "n2", "id", "when", "items", "flag", "kind"],
    "additionalProperties": False,
}
WIDE_INSTANCE = {"s0": "The quick brown fox", "s1": "jumps over", "s2": "the lazy dog", "s3": "again and again",
                 "n0": 3.25, "n1": -17, "n2": 1e-3, "id": "ABC-1234", "when": "2026-12-05",
                 "items": [{"k": "alpha", "v": 1}, {"k": "beta", "v": 22}], "flag": False, "kind": "c"}
CASES = [("api schema", SCHEMA, INSTANCE), ("wide schema", WIDE, WIDE_INSTANCE),
         ("json_object", {"type": "object"}, {"a": [1, 2, {"b": None}], "c": "text"})]
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "meal": {"enum": ["veg", "fish"]}, "note": {"type": "string"}},
    "required": ["seats", "meal"]}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}}}}}
REASONING = ("The user wants two seats with a vegetarian meal. I should call the booking tool, but first let me "
             "check whether a window seat matters: they did not say, so I leave it out. 日本語も少し。 Okay.")
BATCH = 64


def text_of(instance: object) -> str:
    return json.dumps(instance, ensure_ascii=False)  # ", " and ": ", as the grammars write JSON


def stats_us(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"mean {statistics.fmean(samples) * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us"


def median_run(follow: Callable[[], list[float]], runs: int) -> list[float]:
    """follow() `runs` times (each on fresh matchers, as each request gets a copy of the compiled grammar): the run
    whose mean is the median, which a busy shared machine disturbs less than any one run."""
    return sorted((follow() for _ in range(runs)), key=statistics.fmean)[runs // 2]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance

        self.llg = llguidance
        self.prepare_s, self.tokenizer = timed(lambda: llg_tokenizer(tok.path.read_text(encoding="utf-8"), tok.eos_id))
        self.executor = llguidance.LLExecutor()

    def compile(self, grammar: str):
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def masks(self, compiled, ids: list[int], batch: int) -> list[float]:
        """Seconds per step to fill `batch` masks, following ids."""
        import numpy as np

        matchers = [compiled.deep_copy() for _ in range(batch)]
        words = (self.tokenizer.vocab_size + 31) // 32
        buf = np.zeros((batch, words), dtype=np.int32)
        out = []
        for token_id in ids:
            t0 = time.perf_counter()
            if batch == 1:
                matchers[0].unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            else:
                self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], buf.ctypes.data,
                                                      words * 4, batch)
            out.append(time.perf_counter() - t0)
            for m in matchers:
                assert m.consume_token(token_id), m.get_error()
        return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import torch
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.torch = xgrammar, torch
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tok.path), eos_token=syntax.EOS)

        def prepare():
            info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id])
            return xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

        self.prepare_s, self.compiler = timed(prepare)
        self.vocab_size = tok.vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(JSON_OPTIONS["item_separator"],
                                                             JSON_OPTIONS["key_separator"]))

    def masks(self, compiled, ids: list[int], batch: int) -> list[float]:
        matchers = [self.xgr.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = self.xgr.allocate_token_bitmask(batch, self.vocab_size)
        batched = self.xgr.BatchGrammarMatcher(max_threads=2) if hasattr(self.xgr, "BatchGrammarMatcher") else None
        out = []
        for token_id in ids:
            t0 = time.perf_counter()
            if batch > 1 and batched is not None:
                batched.batch_fill_next_token_bitmask(matchers, bitmask)
            else:
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, i)
            out.append(time.perf_counter() - t0)
            for m in matchers:
                assert m.accept_token(token_id), token_id
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="compile each grammar this many times (min is reported)")
    ap.add_argument("--runs", type=int, default=5, help="follow each output this many times (the median run counts)")
    args = ap.parse_args()
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    write_tokenizer_files(folder)
    tok = load_tokenizer(folder)
    libraries = [LLGuidance(tok)]
    try:
        libraries.append(XGrammar(tok))
    except ImportError as e:
        print(f"xgrammar not measured ({e})")
    for lib in libraries:
        print(f"\n== {lib.name}: tokenizer prepared in {lib.prepare_s:.2f} s ({tok.vocab_size} ids)")
        for name, schema, instance in CASES:
            grammar = json_grammar(schema) if lib.name == "llguidance" else schema
            compile_s = min(timed(lambda: lib.compile(grammar))[0] for _ in range(args.repeat))
            compiled = lib.compile(grammar)
            ids = tok.encode(text_of(instance)) + [tok.eos_id]
            one = median_run(lambda: lib.masks(compiled, ids, 1), args.runs)
            many = median_run(lambda: lib.masks(compiled, ids, BATCH), args.runs)
            print(f"{name:12s} compile {compile_s * 1e3:9.2f} ms | batch 1: {stats_us(one)} | batch {BATCH}: "
                  f"{stats_us(many)} per step = {statistics.fmean(many) / BATCH * 1e6:6.1f} us per request "
                  f"({len(ids)} tokens)")
        if lib.name == "llguidance":
            grammar = tool_calls_grammar([BOOK])
            compile_s = min(timed(lambda: lib.compile(grammar))[0] for _ in range(args.repeat))
            call = syntax.render_tool_calls([("book", {"seats": 2, "meal": "veg", "note": "aisle please"})])
            ids = tok.encode(call) + [tok.eos_id]
            compiled = lib.compile(grammar)
            one = median_run(lambda: lib.masks(compiled, ids, 1), args.runs)
            print(f"{'DSML call':12s} compile {compile_s * 1e3:9.2f} ms | batch 1: {stats_us(one)} ({len(ids)} tokens)")
            strict_book = {"type": "function", "function": {**BOOK["function"], "strict": True}}
            grammar = auto_tools_grammar([strict_book, NOTE])
            compile_s = min(timed(lambda: lib.compile(grammar))[0] for _ in range(args.repeat))
            calls = syntax.render_tool_calls([("note", {"text": "two seats, veg"}),
                                              ("book", {"seats": 2, "meal": "veg", "note": "aisle please"})])
            ids = (tok.encode(REASONING) + [tok.token_to_id(syntax.THINK_END)] + tok.encode("Booking now." + calls)
                   + [tok.eos_id])
            compiled = lib.compile(grammar)
            one = median_run(lambda: lib.masks(compiled, ids, 1), args.runs)
            many = median_run(lambda: lib.masks(compiled, ids, BATCH), args.runs)
            print(f"{'auto strict':12s} compile {compile_s * 1e3:9.2f} ms | batch 1: {stats_us(one)} | batch {BATCH}: "
                  f"{stats_us(many)} per step = {statistics.fmean(many) / BATCH * 1e6:6.1f} us per request "
                  f"({len(ids)} tokens)")


if __name__ == "__main__":
    main()
