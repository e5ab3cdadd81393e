"""Fixtures for engine tests: the tiny model (without and with its DSpark stages, and with a vision tower) and
golden-model reference runs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from engine.load import load_model

    return load_model(tiny_checkpoint, progress=False, with_mtp=False)


@pytest.fixture(scope="session")
def tiny_vision_model(tiny_vision_checkpoint):
    """The tiny-vision model (the tiny text model with a 2-block vision tower), without DSpark stages."""
    from engine.load import load_model

    return load_model(tiny_vision_checkpoint, progress=False, with_mtp=False).model


@pytest.fixture(scope="session")
def tiny_model_mtp(tiny_checkpoint):
    """The tiny model with its DSpark stages (speculative decoding)."""
    from engine.load import load_model

    return load_model(tiny_checkpoint, progress=False)


@dataclass(frozen=True)
class GoldenRun:
    tokens: list[int]  # generated ids
    logits: torch.Tensor  # fp32 [R, vocab]: rows at positions first_pos .. (prompt rows the decoder computed, then decodes)
    first_pos: int


def golden_greedy(model, prompt: list[int], num_new: int, replay: bool) -> GoldenRun:
    """The golden model alone: prefill (full logits), then one-token greedy decode steps."""
    cache = model.new_cache(1, len(prompt) + num_new + 1)
    out = model(torch.tensor([prompt]), 0, cache, bounded_replay=replay, full_logits=True)
    rows, first_pos = [out.logits[0]], out.first_pos
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < num_new:
        out = model(torch.tensor([[tokens[-1]]]), cache.seq_len, cache, full_logits=True)
        rows.append(out.logits[0])
        tokens.append(int(out.logits[0, -1].argmax()))
    return GoldenRun(tokens, torch.cat(rows), first_pos)


def random_prompt(length: int, seed: int, vocab: int = 120000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def run_engine(engine, prompts: dict[str, list[int]], params, arrivals: dict[str, int] | None = None,
               keep_logits: bool = False):
    """Drive engine.step() to completion, adding each request at its arrival step.
    Returns {id: (output ids, {position: logits row}, final stats)}."""
    arrivals = arrivals or {}
    results = {rid: ([], {}, None) for rid in prompts}
    step = 0
    pending = dict(prompts)
    while pending or engine.has_unfinished:
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            engine.add_request(rid, pending.pop(rid), params, keep_logits=keep_logits)
        for o in engine.step():
            toks, rows, _ = results.setdefault(o.request_id, ([], {}, None))
            toks += o.new_token_ids
            if o.logits is not None:
                first, block = o.logits
                for i in range(block.size(0)):
                    rows[first + i] = block[i]
            results[o.request_id] = (toks, rows, o.stats if o.finished else None)
        step += 1
        assert step < 10_000
    return results
