"""The golden Transformer on the tiny checkpoint (spec 4.1-4.9): checkpoint layout, prefill / decode /
chunk agreement, bounded replay, batching, greedy decoding, determinism and DSpark drafting.

The expectations are properties that any correct implementation must have (a position's logits do not
depend on how the sequence was split into calls, a request's logits do not depend on its batch mates,
replay leaves the encoder untouched, ...), each checked row by row with a stated tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.layout import BF16, E8M0, F32, FP4_PACKED, FP8, expected_tensors

from .conftest import LONG_LEN, MAX_SEQ_LEN, NUM_GENERATED, PROMPT_LEN, clone_cache

# Logits are fp32 of magnitude ~5. The model rounds to bf16 / FP8 / FP4 between every step, so any
# real divergence (one flipped rounding upstream) shows up as >= 1e-2; agreement is expected to
# ~1e-6 (fp32 output rounding of the same float64 value) and is checked at 1e-4.
LOGITS_ATOL = 1e-4

# dtype of a model buffer for each checkpoint label; packed FP4 pairs are held as uint8 in memory
LABEL_DTYPES = {BF16: torch.bfloat16, F32: torch.float32, FP8: torch.float8_e4m3fn, E8M0: torch.float8_e8m0fnu,
                FP4_PACKED: torch.uint8}


def _assert_logits_close(got: torch.Tensor, expected: torch.Tensor, what: str, atol: float = LOGITS_ATOL) -> None:
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    diff = (got - expected).abs()
    per_row = diff.reshape(-1, diff.size(-1)).amax(-1)
    worst = int(per_row.argmax())
    assert per_row.max().item() <= atol, (
        f"{what}: max |diff| {per_row.max().item():.3g} > {atol:g} (worst row {worst}; rows over: "
        f"{[i for i, v in enumerate(per_row.tolist()) if v > atol]})")
    got_arg = got.reshape(-1, got.size(-1)).argmax(-1)
    exp_arg = expected.reshape(-1, expected.size(-1)).argmax(-1)
    rows = (got_arg != exp_arg).nonzero().flatten().tolist()
    assert not rows, f"{what}: argmax differs on rows {rows}"


def _prefill(model, ids: torch.Tensor, **kwargs):
    cache = model.new_cache(ids.size(0), MAX_SEQ_LEN)
    return model(ids, 0, cache, full_logits=True, **kwargs), cache


# ---- (a) layout ---------------------------------------------------------------------------------

def test_state_dict_matches_the_checkpoint_layout(golden):
    cfg, model = golden.cfg, golden.model
    expected = expected_tensors(cfg, include_vision=False, include_mtp=True)
    state = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    assert not missing and not unexpected, f"missing {missing[:10]}, unexpected {unexpected[:10]}"
    wrong = [(name, tuple(state[name].shape), state[name].dtype, spec.shape, spec.dtype)
             for name, spec in expected.items()
             if tuple(state[name].shape) != spec.shape or state[name].dtype != LABEL_DTYPES[spec.dtype]]
    assert not wrong, f"{len(wrong)} tensors with a wrong shape/dtype, e.g. {wrong[:5]}"
    assert len(model.mtp) == cfg.n_mtp_layers and len(model.layers) == cfg.n_layers


# ---- (b), (f) prefill vs decode, greedy decoding ---------------------------------------------------

def test_prefill_equals_prefill_then_one_token_decode_steps(golden, greedy_run, long_ids):
    """61-token prefill vs prefill of 40 + 21 one-token decode steps (the greedy run), replay off."""
    out, _ = _prefill(golden.model, long_ids)
    assert out.first_pos == 0 and out.logits.shape == (1, LONG_LEN, golden.cfg.vocab_size)
    _assert_logits_close(out.logits[0], greedy_run.logits[:LONG_LEN], f"prefill {LONG_LEN} vs {PROMPT_LEN} + decode")


def test_greedy_decoding_does_not_collapse(golden, greedy_run):
    generated = greedy_run.tokens[PROMPT_LEN:]
    assert len(generated) == NUM_GENERATED
    assert all(0 <= t < golden.cfg.vocab_size for t in generated)
    # a broken cache or position bug typically makes a random model repeat one token forever
    assert len(set(generated)) > NUM_GENERATED // 4, f"greedy output collapsed: {generated}"
    assert len(set(generated[-10:])) > 1, f"greedy output ends in a single repeated token: {generated}"
    # each generated token is the argmax of the logits that produced it
    for i, t in enumerate(generated):
        assert int(greedy_run.logits[PROMPT_LEN - 1 + i].argmax()) == t


# ---- (c) chunked prefill ------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [[17, 23, 21], [1, 1, 3, 56]], ids=str)
def test_chunked_prefill_equals_one_prefill(golden, long_ids, chunks):
    model = golden.model
    whole, whole_cache = _prefill(model, long_ids)
    cache = model.new_cache(1, MAX_SEQ_LEN)
    rows, start = [], 0
    for n in chunks:
        out = model(long_ids[:, start:start + n], start, cache, full_logits=True)
        assert out.first_pos == start
        rows.append(out.logits)
        start += n
    _assert_logits_close(torch.cat(rows, 1), whole.logits, f"chunks {chunks} vs one prefill")
    assert cache.seq_len == whole_cache.seq_len == LONG_LEN
    for s, src in whole_cache.sources.items():  # the global KV does not depend on the split either
        assert torch.equal(cache.sources[s].main_kv, src.main_kv), f"main KV of source {s}"
        assert torch.equal(cache.sources[s].index_k, src.index_k), f"index keys of source {s}"


# ---- (d) bounded replay -------------------------------------------------------------------------

def test_bounded_replay_is_a_no_op_up_to_one_window(golden, long_ids):
    W = golden.cfg.window_size
    ids = long_ids[:, :W]
    off, off_cache = _prefill(golden.model, ids, bounded_replay=False)
    on, on_cache = _prefill(golden.model, ids, bounded_replay=True)
    assert on.first_pos == off.first_pos == 0
    assert torch.equal(on.logits, off.logits)
    assert torch.equal(on.main_hidden, off.main_hidden)
    for layer, (a, b) in enumerate(zip(on_cache.swa, off_cache.swa)):
        assert torch.equal(a, b), f"SWA KV of layer {layer}"


def test_bounded_replay_on_a_long_prompt(golden, long_ids):
    cfg, model = golden.cfg, golden.model
    W, cut = cfg.window_size, cfg.ced_cut
    assert LONG_LEN > W
    off, off_cache = _prefill(model, long_ids, bounded_replay=False)
    on, on_cache = _prefill(model, long_ids, bounded_replay=True)

    # logits only for the replayed last window
    assert on.first_pos == LONG_LEN - W
    assert on.logits.shape == (1, W, cfg.vocab_size)
    assert on.main_hidden.shape == (1, W, len(cfg.dspark_target_layer_ids) * cfg.dim)
    assert torch.isfinite(on.logits).all()
    # replayed queries see a truncated decoder window, so the rows differ from a full forward
    assert not torch.equal(on.logits, off.logits[:, -W:]), "replay on gave exactly the replay-off logits"

    # the encoder (layers < cut) and the cut layer's KV writes see every token either way
    assert on_cache.seq_len == off_cache.seq_len == LONG_LEN
    for layer in range(cut + 1):
        assert torch.equal(on_cache.swa[layer], off_cache.swa[layer]), f"SWA KV of layer {layer} (<= cut {cut})"
    for s in cfg.kv_source_layers:
        assert torch.equal(on_cache.sources[s].main_kv, off_cache.sources[s].main_kv), f"main KV of source {s}"
        assert torch.equal(on_cache.sources[s].index_k, off_cache.sources[s].index_k), f"index keys of source {s}"
        if on_cache.sources[s].pending_kv is not None:
            assert torch.equal(on_cache.sources[s].pending_kv, off_cache.sources[s].pending_kv)
    assert torch.equal(on_cache.engram_history, off_cache.engram_history)
    # decoder layers after the cut hold window KV only for the replayed segment
    for layer in range(cut + 1, cfg.n_layers):
        assert not on_cache.swa[layer][:, :LONG_LEN - W].any(), f"layer {layer} wrote SWA KV before the segment"
        assert on_cache.swa[layer][:, LONG_LEN - W:LONG_LEN].any()

    # decoding continues after a replayed prefill
    token = int(on.logits[0, -1].argmax())
    for pos in range(LONG_LEN, LONG_LEN + 3):
        step = model(torch.tensor([[token]]), pos, on_cache, bounded_replay=True)
        assert step.first_pos == pos and step.logits.shape == (1, cfg.vocab_size)
        assert torch.isfinite(step.logits).all(), f"non-finite logits at decode position {pos}"
        token = int(step.logits[0].argmax())


@pytest.mark.parametrize("bounded_replay", [False, True], ids=["replay-off", "replay-on"])
def test_prefill_reads_no_cache_slot_it_did_not_write(golden, long_ids, bounded_replay):
    """A prefill into a cache full of garbage gives exactly the logits of a prefill into a zeroed one.

    Catches any read of a slot the call did not write first: a window reaching past the query, a
    global entry not yet visible, or (replay on) a replayed query reading decoder window KV from
    before the replay segment, which was never written.
    """
    model = golden.model
    clean, _ = _prefill(model, long_ids, bounded_replay=bounded_replay)
    cache = model.new_cache(1, MAX_SEQ_LEN)
    gen = torch.Generator().manual_seed(11)
    garbage = list(cache.swa)
    for src in cache.sources.values():
        garbage += [src.main_kv, src.index_k]
    for t in garbage:
        t.copy_((torch.randn(t.shape, generator=gen) * 8).to(t.dtype))
    dirty = model(long_ids, 0, cache, full_logits=True, bounded_replay=bounded_replay)
    assert dirty.first_pos == clean.first_pos
    assert torch.equal(dirty.logits, clean.logits), (
        f"garbage in unwritten cache slots changed the logits (max |diff| "
        f"{(dirty.logits - clean.logits).abs().max().item():.3g})")


# ---- (e) batching -------------------------------------------------------------------------------

def test_batch_of_two_equals_each_alone(golden, long_ids, prompt_ids):
    model = golden.model
    n = 29  # odd: leaves a pending ratio-2 token in the caches
    a = long_ids[:, :n]
    b = torch.tensor([list(reversed(prompt_ids))[:n]])
    assert not torch.equal(a, b)
    both, both_cache = _prefill(model, torch.cat([a, b]))
    alone = [_prefill(model, ids) for ids in (a, b)]
    for i, (out, cache) in enumerate(alone):
        _assert_logits_close(both.logits[i:i + 1], out.logits, f"batch row {i} vs alone")
    # one decode step for both rows
    nxt = torch.tensor([[int(both.logits[0, -1].argmax())], [int(both.logits[1, -1].argmax())]])
    step = model(nxt, n, both_cache, full_logits=True)
    for i, (_, cache) in enumerate(alone):
        single = model(nxt[i:i + 1], n, cache, full_logits=True)
        _assert_logits_close(step.logits[i:i + 1], single.logits, f"decode step, batch row {i} vs alone")


# ---- (g) determinism ----------------------------------------------------------------------------

def test_two_runs_are_bitwise_identical(golden, long_ids):
    first, cache1 = _prefill(golden.model, long_ids[:, :37])
    second, cache2 = _prefill(golden.model, long_ids[:, :37])
    assert torch.equal(first.logits, second.logits)
    assert torch.equal(first.main_hidden, second.main_hidden)
    assert all(torch.equal(x, y) for x, y in zip(cache1.swa, cache2.swa))


# ---- (h) DSpark ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dspark_context(golden, long_ids):
    """A cache after a LONG_LEN prefill whose tap hiddens were observed by the DSpark stages, and the anchor."""
    model = golden.model
    out, cache = _prefill(model, long_ids)
    model.dspark_observe(out.main_hidden, out.first_pos, cache)
    anchor = out.logits[:, -1].argmax(-1)  # [1]
    return cache, anchor


def test_dspark_draft_shapes_and_greedy_rule(golden, dspark_context):
    cfg, model = golden.cfg, golden.model
    cache, anchor = dspark_context
    assert cache.dspark_len == LONG_LEN
    blk = cfg.dspark_block_size
    draft = model.dspark_draft(anchor, clone_cache(cache), temperature=0.0)
    assert draft.tokens.shape == (1, blk + 1)
    assert draft.tokens[0, 0] == anchor[0]
    assert bool(((draft.tokens >= 0) & (draft.tokens < cfg.vocab_size)).all())
    assert draft.logits.shape == (1, blk, cfg.vocab_size) and draft.logits.dtype == torch.float32
    assert torch.isfinite(draft.logits).all()
    assert draft.confidence.shape == (1, blk) and torch.isfinite(draft.confidence).all()
    # temperature 0: every drafted token is the argmax of its (Markov-corrected) logits row
    assert draft.tokens[0, 1:].tolist() == draft.logits[0].argmax(-1).tolist()
    # drafting is repeatable and stores nothing: draft tokens are tentative (spec 4.7)
    work = clone_cache(cache)
    again = model.dspark_draft(anchor, work, temperature=0.0)
    assert torch.equal(again.tokens, draft.tokens) and torch.equal(again.logits, draft.logits)
    assert work.dspark_len == cache.dspark_len and work.seq_len == cache.seq_len
    changed = [layer for layer, (a, b) in enumerate(zip(work.swa, cache.swa)) if not torch.equal(a, b)]
    assert not changed, f"dspark_draft wrote into the SWA KV of layers {changed}"
    # temperature > 0 (Gumbel-max with a generator): reproducible per seed, tokens in the vocabulary
    sampled = [model.dspark_draft(anchor, clone_cache(cache), temperature=1.0,
                                  generator=torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])
    assert sampled[0][0, 0] == anchor[0] and bool(((sampled[0] >= 0) & (sampled[0] < cfg.vocab_size)).all())


def test_dspark_markov_correction_is_the_bigram_of_the_previous_token(golden, dspark_context):
    """Returned logits row i = base logits row i + head_markov @ embed_markov[token i] (spec 4.9), where
    the base logits are those of the same draft with the Markov embedding zeroed (then e_i = 0)."""
    model = golden.model
    cache, anchor = dspark_context
    markov = model.mtp[-1].markov_head
    draft = model.dspark_draft(anchor, clone_cache(cache), temperature=0.0)
    saved = markov.embed.weight
    try:
        markov.embed.weight = torch.zeros_like(saved)
        base = model.dspark_draft(anchor, clone_cache(cache), temperature=0.0)
    finally:
        markov.embed.weight = saved
    W_embed, W_head = markov.embed.weight.double(), markov.head.weight.double()
    for i in range(draft.logits.size(1)):
        prev = int(draft.tokens[0, i])
        expected = base.logits[0, i].double() + W_head @ W_embed[prev]
        diff = (draft.logits[0, i].double() - expected).abs().max().item()
        assert diff <= LOGITS_ATOL, f"row {i} (previous token {prev}): max |diff| {diff:.3g}"
        assert int(draft.tokens[0, i + 1]) == int(expected.argmax()), f"row {i}"


def test_dspark_draft_sees_only_the_last_window_of_context(golden, dspark_context):
    cfg, model = golden.cfg, golden.model
    cache, anchor = dspark_context
    W = cfg.window_size
    P = cache.dspark_len - 1  # last observed target position
    stages = range(cfg.n_layers, cfg.n_total_layers)
    reference = model.dspark_draft(anchor, clone_cache(cache), temperature=0.0)

    old = clone_cache(cache)  # perturb the context KV older than the window
    gen = torch.Generator().manual_seed(5)
    for layer in stages:
        older = old.swa[layer][:, :P - W + 1]
        older.copy_(torch.randn(older.shape, generator=gen).bfloat16())
    perturbed = model.dspark_draft(anchor, old, temperature=0.0)
    assert torch.equal(perturbed.tokens, reference.tokens)
    assert torch.equal(perturbed.logits, reference.logits)
    assert torch.equal(perturbed.confidence, reference.confidence)

    inside = clone_cache(cache)  # the oldest position inside the window does matter
    for layer in stages:
        row = inside.swa[layer][:, P - W + 1]
        row.copy_((torch.randn(row.shape, generator=gen) * 4).bfloat16())
    changed = model.dspark_draft(anchor, inside, temperature=0.0)
    assert not torch.equal(changed.logits, reference.logits), "the window's oldest context position had no effect"
