"""Grammar-constrained decoding in the engine (engine/core/grammar.py, the sampler's mask, overlap's rule) on the tiny
random-weight model: only the grammar can make its output valid, so valid output is the grammar's doing.

- The bitmask -> bool unpacking agrees with llguidance's own verdict per token.
- A masked draw takes only allowed tokens (greedy and sampled); logprobs stay the model's.
- JSON with enums, booleans, nested objects and bounded arrays, and DSML tool calls, decoded by the engine, parse
  and validate (jsonschema; the tool's parameters schema), with async scheduling off and on (the same tokens: a
  constrained request's mask for step k+1 needs its token k, so the engine reads the step in flight first).
- JSON in thinking mode: the reasoning is free text up to `</think>`, the content after it the constrained JSON; a
  `</think>` spelled in plain tokens is refused, and a reasoning that never ends stops at max_tokens ("length").
- tool_choice required / named in thinking mode: the grammar spans the reasoning; a calls block forced into it is
  refused, a call after `</think>` validates.
- tool_choice auto with a strict tool: free text; a call the model writes (teacher-forced into the block, which the
  random model would hardly open by itself) has valid arguments; an invalid forced argument is refused.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from engine.chat import parse_completion
from engine.chat import syntax
from engine.chat.constraints import auto_tools_grammar, json_grammar, tool_calls_grammar
from engine.core.engine import LLMEngine, RequestError
from engine.core.grammar import GrammarCompiler
from engine.core.grammar import llg_tokenizer as llg_tokenizer_of
from engine.core.sampler import SampleRow, allowed_tokens, sample
from engine.core.sampling_params import GrammarSpec, SamplingParams
from tests.core.conftest import random_prompt
from tests.core.test_overlap import both, drive, engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "unit": {"enum": ["cm", "in"]}},
                 "required": ["w", "unit"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["ok", "color", "size", "tags"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "window": {"type": "boolean"}, "meal": {"enum": ["veg", "fish"]}},
    "required": ["seats", "meal"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def grammars(tok) -> GrammarCompiler:
    return GrammarCompiler(tok.path.read_text(encoding="utf-8"), tok.eos_id)


@pytest.fixture(scope="module")
def llg_tokenizer(tok) -> llguidance.LLTokenizer:
    return llg_tokenizer_of(tok.path.read_text(encoding="utf-8"), tok.eos_id)


def test_bitmask_unpacks_to_llguidances_verdict(tok, llg_tokenizer):
    grammar = json_grammar(SCHEMA)
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
    matcher.consume_tokens(tok.encode('{"ok": true, "color": "'))
    allowed = allowed_tokens([matcher.compute_bitmask(), None], tok.vocab_size, torch.device("cpu"))
    assert allowed.shape == (2, tok.vocab_size) and allowed[1].all()
    probe = sorted(set(tok.encode('red green blue " } { 7 true')) | {0, 1, 127, 128822, tok.vocab_size - 1})
    for token_id in probe:
        assert bool(allowed[0, token_id]) == (matcher.validate_tokens([token_id]) == 1), token_id
    assert 0 < int(allowed[0].sum()) < 1000


def test_a_masked_draw_takes_only_allowed_tokens_and_reports_raw_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    allowed = torch.zeros(3, 1000, dtype=torch.bool)
    allowed[:, [5, 17, 999]] = True
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=1), 1, 0),
            SampleRow(SamplingParams(temperature=1.0, logprobs=1), 2, 0),
            SampleRow(SamplingParams(temperature=1.0, top_k=2), 3, 0)]
    for step in range(20):
        out = sample(logits, [SampleRow(r.params, r.seed, step) for r in rows], allowed)
        assert all(t in (5, 17, 999) for t in out.token_ids), out.token_ids
    assert out.token_ids[0] == max((5, 17, 999), key=lambda t: logits[0, t])
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert out.logprobs[0].logprob == pytest.approx(float(raw[out.token_ids[0]]))
    assert out.logprobs[0].top[0][0] == int(logits[0].argmax())  # the model's top token, though not allowed
    nothing = sample(logits[:1], rows[:1], torch.zeros(1, 1000, dtype=torch.bool))
    assert nothing.token_ids == [-1] and nothing.errors[0] is not None


def constrained_engine(model, grammars, async_scheduling: bool) -> LLMEngine:
    e = engine(model, async_scheduling)
    e.grammars = grammars
    return e


def run_both(model, grammars, script) -> tuple[dict, dict, LLMEngine]:
    sync = drive(constrained_engine(model, grammars, False), script)
    a = constrained_engine(model, grammars, True)
    return sync, drive(a, script), a


def test_constrained_json_and_tool_calls_validate_with_and_without_async_scheduling(tiny_model, grammars, tok):
    model = tiny_model.model
    json_spec = GrammarSpec(json_grammar(SCHEMA))
    calls_spec = GrammarSpec(tool_calls_grammar([TOOL]))
    script = {
        0: [("add", "free", random_prompt(9, seed=1), SamplingParams(max_tokens=150, temperature=1.0, seed=2)),
            ("add", "json", random_prompt(11, seed=3), SamplingParams(max_tokens=80, temperature=1.0, seed=4,
                                                                       grammar=json_spec, n=2))],
        2: [("add", "calls", random_prompt(7, seed=5), SamplingParams(max_tokens=150, temperature=1.0, seed=6,
                                                                       grammar=calls_spec))],
    }
    sync, overlapped, a = run_both(model, grammars, script)
    assert overlapped == sync
    assert a.executor.num_behind >= 1, "the unconstrained request overlapped once the constrained ones ended"
    for rid in ("json", "json/1"):
        ids, _, reason, _, error = sync[rid]
        assert error is None and reason.value == "stop", (rid, reason, error)
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    ids, _, reason, _, error = sync["calls"]
    assert error is None and reason.value == "stop", tok.decode(ids)
    parsed = parse_completion(tok.decode(ids), thinking=False, tools=[TOOL])
    assert parsed.tool_calls and parsed.content == ""
    for call in parsed.tool_calls:
        assert call.name == "book"
        jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])


def test_json_in_thinking_mode_follows_the_reasoning(tiny_model, grammars, tok, llg_tokenizer):
    """response_format JSON in thinking mode, grammar from the first token. Forced through some reasoning and the
    `</think>` token, the draws write JSON that validates and the parser reads as the whole content; a `</think>`
    spelled in plain tokens (where the parser would start the content) ends the request with the grammar's error;
    left to itself, the random model reasons until max_tokens: finish reason "length", no error, no content, and no
    special token but the think pair in the reasoning."""
    think_end, think_start = tok.token_to_id(syntax.THINK_END), tok.token_to_id(syntax.THINK_START)
    spelled = tok.encode("</") + tok.encode("think>")
    assert tok.decode(spelled) == syntax.THINK_END and think_end not in spelled
    cases = {"closed": tok.encode("Some reasoning") + [think_end], "spelled": tok.encode("Some reasoning") + spelled,
             "open": []}
    script = {0: [("add", rid, random_prompt(8, seed=7 + i), SamplingParams(
        max_tokens=30 if rid == "open" else 120, temperature=1.0, seed=9 + i,
        grammar=GrammarSpec(json_grammar(SCHEMA, thinking=True))), ids) for i, (rid, ids) in enumerate(cases.items())]}
    out = drive(constrained_engine(tiny_model.model, grammars, False), script)
    ids, _, reason, _, error = out["closed"]
    assert error is None and reason.value == "stop" and ids[:len(cases["closed"])] == cases["closed"], (reason, error)
    parsed = parse_completion(tok.decode(ids), thinking=True)
    assert parsed.reasoning_content == "Some reasoning" and not parsed.tool_calls
    jsonschema.validate(json.loads(parsed.content), SCHEMA)
    assert parsed.content == tok.decode(ids[len(cases["closed"]):])
    ids, _, reason, _, error = out["spelled"]
    assert reason.value == "error" and "grammar does not allow" in error, (reason, error)
    ids, _, reason, _, error = out["open"]
    assert error is None and reason.value == "length" and len(ids) == 30, (reason, error)
    assert not {t for t in ids if llg_tokenizer.is_special_token(t)} - {think_start, think_end}
    if think_end not in ids:  # (the random model draws it about once in 100,000 tokens)
        parsed = parse_completion(tok.decode(ids), thinking=True)
        assert parsed.content == "" and parsed.reasoning_content and not parsed.tool_calls


def test_a_grammar_that_does_not_compile_is_refused(tiny_model, grammars):
    e = constrained_engine(tiny_model.model, grammars, False)
    with pytest.raises(RequestError, match="grammar"):
        e.add_request("bad", [1, 2, 3], SamplingParams(grammar=GrammarSpec("start: nonexistent_rule\n")))
    assert not e.requests
    e.grammars = None
    with pytest.raises(RequestError, match="no grammar compiler"):
        e.add_request("none", [1, 2, 3], SamplingParams(grammar=GrammarSpec(json_grammar({"type": "object"}))))


def test_compiled_grammars_are_cached(grammars):
    spec = GrammarSpec(json_grammar({"type": "object", "properties": {"cache_probe": {"type": "boolean"}}}))
    before = grammars.num_compiled
    first, second = grammars.matcher(spec), grammars.matcher(spec)
    assert grammars.num_compiled == before + 1 and first is not second
    assert first.mask() == second.mask()


def test_strict_tool_calls_under_auto(tiny_model, grammars, tok, llg_tokenizer):
    """The strict tools' grammar of tool_choice auto, from the first token: forced into a calls block (after content,
    or straight after the reasoning's </think>) and then left to the random model, the draws complete a call of the
    strict tool whose arguments validate; a forced argument out of range ends the request with the grammar's error;
    unforced, the model writes free text with no special token but the think pair (none to splice the calls tag)."""
    note = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}}}}}  # not strict
    tools = [{"type": "function", "function": {**TOOL["function"], "strict": True}}, note]
    think_end = tok.token_to_id(syntax.THINK_END)
    head = f"Booking it.{syntax.CALLS_SEPARATOR}{syntax.CALLS_OPEN}\n{syntax.INVOKE_OPEN} name=\"book\">\n"
    forced = {"content": tok.encode(head), "reasoning": tok.encode("Plan: book.") + [think_end] + tok.encode(head),
              "bad": tok.encode(head + f'{syntax.PARAM_OPEN} name="seats" string="false">0')}

    def params(seed: int, max_tokens: int = 150) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, grammar=GrammarSpec(
            auto_tools_grammar(tools)))

    script = {0: [("add", rid, random_prompt(8, seed=20 + i), params(30 + i), ids)
                  for i, (rid, ids) in enumerate(forced.items())]
              + [("add", "free", random_prompt(8, seed=29), params(39, max_tokens=60))]}
    out = drive(constrained_engine(tiny_model.model, grammars, False), script)
    for rid in ("content", "reasoning"):
        ids, _, reason, _, error = out[rid]
        text = tok.decode(ids)
        assert error is None and ids[:len(forced[rid])] == forced[rid], (rid, error)
        parsed = parse_completion(text, thinking=rid == "reasoning", tools=tools)
        assert parsed.tool_calls and parsed.tool_calls[0].name == "book", (rid, text)
        for call in parsed.tool_calls:
            if call.name == "book":
                jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
        if reason.value == "stop":  # the grammar completed: the block is closed and nothing follows it
            assert text.endswith(syntax.CALLS_CLOSE), text
    ids, _, reason, _, error = out["bad"]
    assert reason.value == "error" and "grammar does not allow" in error, (reason, error)
    ids, _, reason, _, error = out["free"]
    assert error is None and reason.value == "length" and len(ids) == 60, (reason, error)
    special = {t for t in ids if llg_tokenizer.is_special_token(t)} - {think_end, tok.token_to_id(syntax.THINK_START)}
    assert not special, special



def test_forced_calls_in_thinking_mode_span_the_reasoning(tiny_model, grammars, tok, llg_tokenizer):
    """tool_choice named / required in thinking mode, grammar from the first token. Teacher-forced into a calls block
    inside the reasoning (which the parser would return as the call), the request ends with the grammar's error;
    forced through the reasoning and `</think>` (and, for required, the block's head), the model's constrained draws
    complete a call that validates and the request stops at the block's close; unforced, the reasoning holds no
    special token but the think pair and no calls tag."""
    cancel = {"type": "function", "function": {"name": "cancel", "parameters": {"type": "object", "properties": {
        "ref": {"enum": ["A1", "B2"]}}, "required": ["ref"]}}}
    tools = [TOOL, cancel]
    named, required = tool_calls_grammar(tools, "book", thinking=True), tool_calls_grammar(tools, thinking=True)
    think_end = tok.token_to_id(syntax.THINK_END)
    head = f"{syntax.CALLS_SEPARATOR}{syntax.CALLS_OPEN}\n{syntax.INVOKE_OPEN} name=\"book\">\n"
    cases = {"inside-named": (named, tok.encode("Plan: book." + head)),
             "inside-required": (required, tok.encode("Plan: book." + head)),
             "after-named": (named, tok.encode("Plan: book.") + [think_end]),
             "after-required": (required, tok.encode("Plan: book.") + [think_end] + tok.encode(head)),
             "free": (required, [])}
    script = {0: [("add", rid, random_prompt(8, seed=40 + i),
                   SamplingParams(max_tokens=60 if rid == "free" else 150, temperature=1.0, seed=50 + i,
                                  grammar=GrammarSpec(grammar)), ids)
                  for i, (rid, (grammar, ids)) in enumerate(cases.items())]}
    out = drive(constrained_engine(tiny_model.model, grammars, False), script)
    for rid in ("inside-named", "inside-required"):
        assert parse_completion(tok.decode(cases[rid][1]), thinking=True, tools=tools).tool_calls  # the parser's call
        ids, _, reason, _, error = out[rid]
        assert reason.value == "error" and "grammar does not allow" in error, (rid, reason, error)
    for rid in ("after-named", "after-required"):
        ids, _, reason, _, error = out[rid]
        text = tok.decode(ids)
        assert error is None and ids[:len(cases[rid][1])] == cases[rid][1], (rid, error)
        # named: one call, then the grammar ends the request; required may add calls up to max_tokens
        assert reason.value == "stop" if rid == "after-named" else reason.value in ("stop", "length"), (rid, reason)
        assert text.endswith(syntax.CALLS_CLOSE) or reason.value == "length", text
        parsed = parse_completion(text, thinking=True, tools=tools)
        assert parsed.reasoning_content == "Plan: book." and parsed.content == "", parsed
        assert parsed.tool_calls[0].name == "book" and (len(parsed.tool_calls) == 1 or rid == "after-required"), parsed
        jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), TOOL["function"]["parameters"])
    ids, _, reason, _, error = out["free"]
    assert error is None, error
    special = {t for t in ids if llg_tokenizer.is_special_token(t)} - {think_end, tok.token_to_id(syntax.THINK_START)}
    assert not special and syntax.CALLS_OPEN not in tok.decode(ids[:ids.index(think_end)] if think_end in ids
                                                                else ids), special


def test_the_decode_step_applies_grammar_masks_as_the_eager_step(tiny_model, grammars):
    """Constrained decode steps run through the decode step (its draw applies the staged bitmasks,
    engine/kernels/token_mask.py), beside an unconstrained request: the same tokens and logprobs as the kernel
    path's eager step, whose host sampler applies the masks."""
    from tests.core.test_decode_step import assert_same_draws, kernel_engine, run

    spec = GrammarSpec(json_grammar(SCHEMA))
    arrivals = {"greedy": (random_prompt(8, seed=7), SamplingParams(max_tokens=5, grammar=spec, logprobs=1), 0),
                "sampled": (random_prompt(6, seed=8), SamplingParams(max_tokens=5, temperature=1.0, seed=9,
                                                                     grammar=spec), 0),
                "free": (random_prompt(5, seed=10), SamplingParams(max_tokens=4), 1)}

    def with_grammars(e: LLMEngine) -> LLMEngine:
        e.grammars = grammars
        return e

    legacy = run(with_grammars(kernel_engine(tiny_model.model, decode_step=False)), arrivals)
    e = with_grammars(kernel_engine(tiny_model.model, decode_step=True))
    step, masked = e.executor.runner.decode, []
    launch = step.launch
    step.launch = lambda plan: (masked.append(sum(s.allowed is not None for s in plan.samples)), launch(plan))[1]
    assert_same_draws(run(e, arrivals), legacy)
    assert max(masked) == 2  # masked draws went through the decode step
