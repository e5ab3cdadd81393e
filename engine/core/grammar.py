"""Grammar-constrained decoding, the engine's side (llguidance; no torch): a matcher per request whose token
bitmask the sampler applies (engine/core/sampler.py) and which then consumes the drawn token.

The mask is computed on the CPU by the engine before a step's draw: one bit per token id, little-endian 32-bit words
as llguidance writes them (`bytes`, 16,160 for V4.1's 129,280 ids), so it travels in the plan as plain data
(`SampleSpec.allowed`) or, for a decode step launched before its masks were known, to its draw
(engine/core/overlap.py). A step's masks are computed together (`GrammarCompiler.masks`): several on llguidance's
threads, outside the GIL (LLExecutor), one on the calling thread. A request's mask for step k+1 needs its token of
step k, so with async scheduling the engine launches step k+1's forward, reads step k's tokens, and only then
computes the masks and launches step k+1's draw.

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

import os
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

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


MASK_THREADS = 2  # default llguidance threads: a constrained batch-64 step on the H100 (2026-12-06, H100 host with 16
# CPUs, engine_decode --grammar on) took 2.7-2.9 ms with 2 threads, 3.1-4.3 with 1, 3.9-4.2 with 4, 3.9-4.8 with 16:
# 64 masks of a JSON string cost ~0.6 ms on one thread, and more threads added more waiting than they saved


class GrammarCompiler:
    """tokenizer_json: the tokenizer.json text; eos_id: the end-of-sentence id (allowed once a grammar accepts);
    num_threads: llguidance's threads for a step's masks (None: MASK_THREADS, at most the CPUs this process may run
    on)."""

    def __init__(self, tokenizer_json: str, eos_id: int, max_cached: int = 256, num_threads: int | None = None) -> None:
        self._tokenizer = llg_tokenizer(tokenizer_json, eos_id)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._max_cached = max_cached
        self.num_compiled = 0
        self.num_threads = num_threads or min(MASK_THREADS, len(os.sched_getaffinity(0)))
        self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
        self.mask_words = (self._tokenizer.vocab_size + 31) // 32  # int32 words of one mask

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

    def masks(self, matchers: Sequence[GrammarMatcher]) -> list[bytes]:
        """Each matcher's mask() cut to the vocabulary's 4 * mask_words bytes (mask() has one more word, of the ids
        past the vocabulary: all zero), several at once on the executor's threads."""
        if len(matchers) == 1:
            return [matchers[0].mask()[:4 * self.mask_words]]
        out = self.fill_masks(matchers, np.empty((len(matchers), self.mask_words), dtype=np.int32))
        return [row.tobytes() for row in out]

    def fill_masks(self, matchers: Sequence[GrammarMatcher], out: np.ndarray) -> np.ndarray:
        """Row i of out (int32 [>= len(matchers), mask_words], C-contiguous) <- matchers[i]'s mask, in parallel
        outside the GIL (llguidance's LLExecutor); returns out. Each matcher at most once (llguidance borrows it).
        llguidance takes rows of exactly mask_words words."""
        assert out.dtype == np.int32 and out.flags.c_contiguous and out.shape[1] == self.mask_words, \
            (out.dtype, out.shape, self.mask_words)
        assert out.shape[0] >= len(matchers), f"{out.shape[0]} rows for {len(matchers)} masks"
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, 4 * self.mask_words, out.shape[0])
        return out
