"""The draw of a vocab-parallel head without its logits gathered (engine/core/sharded_draw.py) against the draw on
the whole row (sampler.sample_device): N ranks run as threads, each with its slice of the row, and a barrier-based
all-gather stands in for the collective; every rank must return sample_device's tokens. Also gumbel_max over a
slice against the whole row's noise at the slice's ids (the Triton kernel under the interpreter and the reference)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.core.sampler import sample_device, sample_variant
from engine.core.sampling_params import SamplingParams
from engine.core.sharded_draw import draws_sharded, sample_sharded
from engine.kernels.gumbel import gumbel_max, gumbel_max_ref, gumbel_noise_ref
from engine.shard_spec import ShardSpec
from tests.core.test_sampler import sample_tensors


class ThreadGather:
    """all_gather for N threads: each puts its tensor in its rank's place; all read the stack once all are in."""

    def __init__(self, n: int):
        self.parts: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def __call__(self, x: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
        self.parts[shard.rank] = x
        self.barrier.wait()
        out = torch.stack(self.parts)
        self.barrier.wait()  # nobody overwrites its part before every rank has read the stack
        return out


def draw_on_ranks(logits: torch.Tensor, t, variant: str, n: int) -> list[list[int]]:
    """Every rank's tokens, its slice of logits in hand."""
    width = logits.size(1) // n
    gather, out, errors = ThreadGather(n), [None] * n, []

    def rank(r: int) -> None:
        try:
            local = logits[:, r * width:(r + 1) * width].contiguous()
            out[r] = sample_sharded(local, t, variant, ShardSpec(r, n), gather).token_ids.tolist()
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(e)
            gather.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def rows_with_edges(num_rows: int, V: int, n: int, seed: int) -> torch.Tensor:
    """Random logits with the cases a split can get wrong: the row's max tied across ranks (first one must win),
    a NaN or +inf in one slice, all -inf, a slice all -inf, the max at the last id of a slice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, V, generator=g) * 2
    w = V // n
    x[0, w + 3] = x[0, 2 * w - 1] = x[0, 5] = 9.0  # ties in ranks 0 and 1: id 5 is the greedy token
    x[1, 2 * w - 1] = 8.0  # max at a slice's last id
    x[2, -1] = float("nan")
    x[3, :] = float("-inf")
    x[4, :w] = float("-inf")  # rank 0's slice has nothing to draw
    x[5, w] = float("inf")
    x[6] = torch.round(x[6])  # many ties at every value
    return x


PARAMS = [SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3),
          SamplingParams(temperature=0.9, min_p=0.05), SamplingParams(temperature=1.0, min_p=0.3),
          SamplingParams(temperature=0.5), SamplingParams(temperature=2.0, min_p=0.01), SamplingParams()]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("variant", ["greedy", "plain"])
def test_ranks_draw_the_whole_rows_tokens(n: int, variant: str):
    V = 96
    logits = rows_with_edges(len(PARAMS), V, n, seed=n)
    params = [p if variant == "plain" else SamplingParams() for p in PARAMS]
    assert sample_variant(params) == variant
    forces = [None, None, 17, None, None, None, None, 40]
    for step in range(12):  # different noise every step
        t = sample_tensors([(p, 1000 + i, step, f) for i, (p, f) in enumerate(zip(params, forces))], V)
        want = sample_device(logits, t, variant, 0).token_ids.tolist()
        got = draw_on_ranks(logits, t, variant, n)
        assert all(g == want for g in got), (step, want, got)
    assert want[2:4] == [-1, -1] and want[5] == -1  # the unusable rows fail on every rank
    if variant == "greedy":
        assert want[0] == 5


def test_a_plain_draw_reaches_every_rank():
    """Over many steps the drawn ids fall in every rank's slice (the split draws, it does not favour a rank)."""
    n, V = 4, 64
    logits = torch.zeros(1, V)  # uniform: every id equally likely
    hits = set()
    for step in range(64):
        t = sample_tensors([(SamplingParams(temperature=1.0), 3, step, None)], V)
        tok = draw_on_ranks(logits, t, "plain", n)[0][0]
        assert tok == sample_device(logits, t, "plain", 0).token_ids.item()
        hits.add(tok // (V // n))
    assert hits == set(range(n))


def test_only_greedy_and_plain_without_logprobs_skip_the_gather():
    assert draws_sharded("greedy", 0) and draws_sharded("plain", 0)
    assert not draws_sharded("filtered", 0) and not draws_sharded("greedy", SamplingParams.MAX_LOGPROBS)
    with pytest.raises(AssertionError, match="whole row"):
        sample_sharded(torch.zeros(1, 8), None, "filtered", ShardSpec(0, 2))


@pytest.mark.parametrize("first_id", [0, 4, 1024, 64_640])
def test_gumbel_max_of_a_slice_is_the_whole_rows_noise_at_its_ids(first_id: int):
    g = torch.Generator().manual_seed(first_id)
    x = torch.randn(3, 200, generator=g)
    x[2, :150] = float("-inf")
    seeds, steps = torch.tensor([1, -7, 2**40]), torch.tensor([0, 5, 2**33])
    noise = gumbel_noise_ref(seeds, steps, first_id + 200)[:, first_id:]
    want_val, want_at = (x + noise).max(dim=-1)
    for draw in (gumbel_max_ref, gumbel_max):
        val, at = draw(x, seeds, steps, first_id)
        assert at.tolist() == want_at.tolist() and torch.equal(val, want_val), draw.__name__
    val, at = gumbel_max(torch.full((1, 9), float("-inf")), seeds[:1], steps[:1], first_id)
    assert at.item() == 0 and val.item() == float("-inf")
    with pytest.raises(AssertionError, match="multiple of 4"):
        gumbel_max(x, seeds, steps, 2)
