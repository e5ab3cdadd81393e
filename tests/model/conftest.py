"""Fixtures for the golden-model tests: one tiny random-weight checkpoint per session (seed 0), the model
loaded from it, and one greedy run whose logits several transformer tests share.

The shared objects are read-only by convention: a test that runs the model allocates its own cache.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

PROMPT_TEXT = (
    "The lighthouse keeper wrote in his log every evening: the wind, the colour of the sea, the ships that "
    "passed and the ones that did not. After forty years the log filled a shelf, and nobody had read it."
)
PROMPT_LEN = 40  # prefill length of the greedy run
NUM_GENERATED = 40  # greedy tokens after the prompt
LONG_LEN = 61  # "61-token prompt": the prompt plus the first 21 greedy tokens
MAX_SEQ_LEN = 96


@pytest.fixture(scope="session")
def golden(tiny_checkpoint):
    """engine.load.LoadedModel (cfg, tokenizer, model) of the tiny checkpoint (tests/conftest.py: tiny preset, seed 0),
    with the DSpark stages."""
    from engine.load import load_model

    return load_model(tiny_checkpoint, progress=False)


@pytest.fixture(scope="session")
def prompt_ids(golden) -> list[int]:
    ids = golden.tokenizer.encode(PROMPT_TEXT)
    assert len(ids) >= PROMPT_LEN, f"prompt text gives only {len(ids)} tokens"
    return ids[:PROMPT_LEN]


@dataclass(frozen=True)
class GreedyRun:
    tokens: list[int]  # prompt + NUM_GENERATED greedy tokens
    logits: torch.Tensor  # fp32 [len(tokens) - 1, vocab]: row i predicts token i + 1 (prefill rows, then decode rows)


@pytest.fixture(scope="session")
def greedy_run(golden, prompt_ids) -> GreedyRun:
    """Prefill PROMPT_LEN tokens, then NUM_GENERATED - 1 one-token greedy decode steps (bounded replay off)."""
    model = golden.model
    cache = model.new_cache(1, MAX_SEQ_LEN)
    tokens = list(prompt_ids)
    out = model(torch.tensor([tokens]), 0, cache, full_logits=True)
    rows = [out.logits[0]]
    tokens.append(int(out.logits[0, -1].argmax()))
    while len(tokens) < PROMPT_LEN + NUM_GENERATED:
        pos = len(tokens) - 1
        out = model(torch.tensor([[tokens[-1]]]), pos, cache, full_logits=True)
        rows.append(out.logits[0])
        tokens.append(int(out.logits[0, -1].argmax()))
    return GreedyRun(tokens, torch.cat(rows))


@pytest.fixture(scope="session")
def long_ids(greedy_run) -> torch.Tensor:
    """[1, LONG_LEN] int64: the prompt followed by the first greedy tokens."""
    return torch.tensor([greedy_run.tokens[:LONG_LEN]])


def clone_cache(cache):
    """A deep copy of a ModelCache (tensors cloned)."""
    return copy.deepcopy(cache)
