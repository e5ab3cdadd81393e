"""Per-request sampling parameters (plain data, no torch): validated at the edge, read by the sampler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output (engine/core/grammar.py): llguidance grammar text (engine/chat/constraints.py
    writes it), enforced from the first output token."""

    grammar: str


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names the field (the API turns it into a 400)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy (top_p/top_k/min_p are then ignored); so is any temperature below
    MIN_TEMPERATURE (dividing the logits by it overflows fp32 towards inf, and such a temperature puts
    almost all the mass on the argmax; vLLM's _SAMPLING_EPS is the same floor). top_k 0 means off.
    `seed` makes sampling reproducible whatever else shares the batch; None draws one at admission.
    `logprobs` None returns none; k >= 0 returns the sampled token's logprob plus the k most likely."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    logprobs: int | None = None
    n: int = 1
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None  # constrained decoding

    MAX_LOGPROBS = 20
    MIN_TEMPERATURE = 1e-5

    def validate(self) -> "SamplingParams":
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SamplingError(f"{name} must be {what}, got {getattr(self, name)!r}")

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        need(_is_number(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "between 0 and 2")
        need(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")
        need(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed",
             "null or an integer in [0, 2^63)")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "a list of non-negative token ids")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
             "logprobs", f"null or an integer in [0, {self.MAX_LOGPROBS}]")
        need(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < self.MIN_TEMPERATURE


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
