"""The kernel path's model-parallel pieces without processes: the solo collectives (measurement mode), and the
expert- / tensor-parallel MoE on the kernels, two ranks' fp32 partials summed by hand standing in for the
all-reduce, against the one-shard kernel MoE.

MoE numerics (engine/kernels/moe.py): a rank returns P = [Σ over its pairs of bf16(o_tj), its shared-expert
partial] in fp32, and y = bf16(R + bf16(S)) of the ranks' sums. At one shard this is moe_forward's y bit for bit.
At two shards R sums the same bf16 values in another association and S the same exact products over another
K split, each within a few fp32 ULPs of the one-shard sums (2^-20 of |R| + |S| bounds it with margin), so y is the
one-shard y up to one bf16 ULP of y where that rounding moves (plus one ULP of bf16(S), whose rounding may move
too); at least 99% of the elements are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.kernel_ops import moe_kernels
from engine.kernels.moe import moe_finish, moe_finish_ref, moe_forward, stack_experts
from engine.load import load_model
from engine.parallel import GroupAddress, ProcessGroups, ShardSpec, all_gather, all_reduce_sum
from tests.kernels.numeric import bf16_ulp

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYER = 3  # a Reuse layer: its MoE has all 8 routed experts, 2 a token, and the shared expert


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """The tiny model whole, and its two ranks (each loading only its slices)."""
    load = lambda shard: load_model(tiny_checkpoint, progress=False, with_mtp=False, shard=shard).model  # noqa: E731
    return load(ShardSpec()), [load(ShardSpec(r, 2)) for r in range(2)]


def tokens(t: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, d, generator=g) * torch.logspace(-1, 0.5, d)).bfloat16()


def test_solo_collectives_move_the_shapes_without_peers():
    solo = ShardSpec(0, 8, solo=True)
    x = torch.randn(3, 5)
    assert all_reduce_sum(x, solo) is x
    gathered = all_gather(x, solo, dim=-1)
    assert gathered.shape == (3, 40) and torch.equal(gathered[:, 35:], x)
    with pytest.raises(AssertionError, match="solo"):
        ProcessGroups.join(solo, GroupAddress("127.0.0.1", 1), torch.device("cpu"), None)


def test_moe_finish_is_its_reference():
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(2, 5, 96, generator=g) * torch.logspace(-3, 2, 96)
    assert torch.equal(moe_finish(parts).view(torch.int16), moe_finish_ref(parts).view(torch.int16))


@pytest.mark.parametrize("t", [1, 5])
def test_two_ranks_partials_give_the_one_shard_moe(models, t):
    whole, ranks = models
    moe = whole.layers[LAYER].ffn
    x = tokens(t, moe.gate.weight.size(1), seed=t)
    one = moe_kernels(x, moe)
    experts = stack_experts(moe)
    parts_one = moe_forward(x, moe, experts, partial=True)
    assert torch.equal(moe_finish(parts_one).view(torch.int16), one.view(torch.int16)), "one shard: P -> y differs"

    rank_moes = [m.layers[LAYER].ffn for m in ranks]
    assert [len(m.local_experts) for m in rank_moes] == [4, 4] and rank_moes[1].experts[0] is None
    parts = [moe_forward(x, m, stack_experts(m), partial=True) for m in rank_moes]
    y = moe_finish(parts[0] + parts[1])  # the all-reduce, by hand
    r1, s1 = parts_one.double()
    bound = bf16_ulp(one) + bf16_ulp(s1) + 2.0**-20 * (r1.abs() + s1.abs())
    err = (y.double() - one.double()).abs()
    bad = ~(err <= bound)
    worst = int(torch.where(bad, err / bound, -1.0).argmax())
    assert not bad.any(), (f"T={t}: {int(bad.sum())}/{bad.numel()} elements out of tolerance; worst flat {worst}: "
                           f"two ranks {y.flatten()[worst].item():.6g} one {one.flatten()[worst].item():.6g} "
                           f"allowed {bound.flatten()[worst].item():.3g}")
    same = (y.view(torch.int16) == one.view(torch.int16)).double().mean().item()
    assert same >= 0.99, f"T={t}: only {same:.2%} bitwise equal to one shard"
    # each rank summed its own experts' pairs and its shared features: the two partials add up to one shard's
    summed = (parts[0] + parts[1]).double()
    assert ((summed - parts_one.double()).abs() <= 2.0**-20 * (parts[0].abs() + parts[1].abs())).all()
    if t > 1:
        assert all(p[0].abs().sum() > 0 for p in parts), "a rank got no pairs: the split was not exercised"
