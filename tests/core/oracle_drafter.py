"""A test drafter (engine/core/drafter.py's Drafter seam): it proposes the target's own continuation, known from a
run without drafts, optionally wrong at chosen positions, so that tests control which drafts are accepted."""

from __future__ import annotations

import math

import torch

from engine.core.drafter import Draft, DraftRequest


class OracleDrafter:
    """sequences: full token sequences (prompt + the target's output). A request is found by the ids it ends with
    (its look-back and anchor at the anchor's position); its drafts are the sequence's next tokens, each a one-hot
    draft distribution with certain confidence. wrong: positions whose draft is replaced by another token (the
    next id), so the verify rejects it there. Past a sequence's end it proposes token 0."""

    def __init__(self, sequences: list[list[int]], vocab_size: int, wrong: frozenset[int] = frozenset()):
        self.sequences, self.vocab_size, self.wrong = sequences, vocab_size, wrong
        self.num_proposed = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._draft(r) for r in requests]

    def _draft(self, r: DraftRequest) -> Draft:
        seq = self._sequence(r)
        tokens = []
        for p in range(r.position + 1, r.position + 1 + r.num_tokens):
            t = seq[p] if p < len(seq) else 0
            tokens.append((t + 1) % self.vocab_size if p in self.wrong else t)
        q = torch.zeros(len(tokens), self.vocab_size, dtype=torch.float64)
        q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
        self.num_proposed += len(tokens)
        return Draft(tokens, q, [math.inf] * len(tokens))

    def _sequence(self, r: DraftRequest) -> list[int]:
        ids = r.prev_ids + [r.anchor]
        first = r.position + 1 - len(ids)
        for seq in self.sequences:
            if seq[first:r.position + 1] == ids:
                return seq
        raise AssertionError(f"no known sequence has {ids} at positions {first}..{r.position}")
