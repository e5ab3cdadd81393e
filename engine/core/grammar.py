"""Grammar-constrained decoding, the engine's side (llguidance; no torch): a matcher per request whose token
bitmask the sampler applies (engine/core/sampler.py) and which then consumes the drawn token.

The mask is computed on the CPU by the engine before it builds a step's plan: one bit per token id, little-endian
32-bit words as llguidance writes them (`bytes`, 16,160 for V4.1's 129,280 ids), so it travels in the plan as plain
data (`SampleSpec.allowed`). A request's mask for step k+1 needs its token of step k, so while a constrained
request runs the engine does not launch a step behind the one in flight (engine/core/overlap.py: can_overlap),
and a plan with a mask runs through the runner's eager step, where `sample_specs` applies it: the decode step's
CUDA-graph draw does not apply masks yet (engine/core/decode_buckets.py: decode_takes).

Once the grammar is complete (`is_done`) the request ends (finish reason "stop"), as vLLM ends a request whose
structured output is terminated.

`GrammarCompiler` builds the tokenizer's llguidance view once (`llg_tokenizer`, ~1.2 s for 129,280 ids) and caches
one compiled matcher per grammar text (an LRU of `max_cached`); each request gets a copy of the cached matcher.

A mask is a walk of the vocabulary's token trie through the grammar's lexer, ~1.5-3 ms for 129,280 ids on one CPU
core, except where llguidance can prove that a whole token slice may follow (then the slice is added at once) or
the lexer state is the previous mask's (then that mask is reused). `TOKEN_SLICES` are llguidance's JSON slices
(whitespace runs; runs of JSON string characters of up to 10, 30 or any length) without "<": so they also fit
the states inside the tool grammars' free text and inside the tag-free JSON strings (engine/chat/constraints.py),
which refuse only texts that start at a "<"; with "<" in them no slice fits there and every such mask walked the
whole vocabulary (benchmarks/RESULTS.md, structured output).
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance

from engine.core.sampling_params import GrammarSpec


TOKEN_SLICES = [r"[\x20\x0A\x0D\x09]+", *(r'[^"\\\x00-\x1F\x7F<]' + n for n in ("{1,10}", "{1,30}", "+"))]


def llg_tokenizer(tokenizer_json: str, eos_id: int) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer (tokenizer.json's text), with TOKEN_SLICES."""
    return llguidance.LLTokenizer(tokenizer_json, eos_token=eos_id, slices=TOKEN_SLICES)


class GrammarError(ValueError):
    """A grammar the matcher could not compile against the tokenizer; the message is llguidance's."""


class GrammarMatcher:
    """One request's grammar state: `mask()` before each draw, `accept(token)` after it."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def mask(self) -> bytes:
        """The allowed tokens of the next draw as a bitmask."""
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> bool:
        """Consume a drawn token; False if the grammar does not allow it (the request should fail)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """The grammar is complete: nothing but the end-of-sentence token may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """tokenizer_json: the tokenizer.json text; eos_id: the end-of-sentence id (allowed once a grammar accepts)."""

    def __init__(self, tokenizer_json: str, eos_id: int, max_cached: int = 256) -> None:
        self._tokenizer = llg_tokenizer(tokenizer_json, eos_id)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._max_cached = max_cached
        self.num_compiled = 0

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for spec; raises GrammarError."""
        template = self._cache.get(spec.grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, spec.grammar, log_level=0)
            if template.is_error():
                raise GrammarError(template.get_error().strip().splitlines()[0])
            self.num_compiled += 1
            self._cache[spec.grammar] = template
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec.grammar)
        return GrammarMatcher(template.deep_copy())
