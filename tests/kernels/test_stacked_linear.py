"""fp8_linear.stacked_fp8: two FP8 linears of the same input as one launch over their stacked rows (the runner's
wkv | wq_a at decode, the shared expert's W1 | W3). The stack holds the weights once (the modules' buffers become
views of it), its product is the two products side by side, and formats that do not stack are refused."""

from __future__ import annotations

import torch

from engine.kernels.fp8_linear import fp8_linear_ref, stacked_fp8
from engine.model.layers import Linear
from engine.quant import quant_fp8_weight


def _fp8_linear(rows: int, cols: int, seed: int) -> Linear:
    lin = Linear(cols, rows, "fp8")
    g = torch.Generator().manual_seed(seed)
    lin.weight, lin.scale = quant_fp8_weight(torch.randn(rows, cols, generator=g) * 0.05)
    return lin


def test_stack_is_the_two_products_and_holds_the_weights_once():
    a, b = _fp8_linear(64, 96, seed=0), _fp8_linear(40, 96, seed=1)  # b's 40 rows: a partial last scale block
    wa, sa, wb, sb = (t.clone() for t in (a.weight, a.scale, b.weight, b.scale))
    both = stacked_fp8(a, b)
    assert both is not None and tuple(both.weight.shape) == (104, 96) and tuple(both.scale.shape) == (4, 3)
    for view, stack, offset in ((a.weight, both.weight, 0), (b.weight, both.weight, 64 * 96),
                                (a.scale, both.scale, 0), (b.scale, both.scale, 2 * 3)):
        assert view.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
        assert view.storage_offset() == offset
    for now, before in ((a.weight, wa), (a.scale, sa), (b.weight, wb), (b.scale, sb)):
        assert torch.equal(now.view(torch.uint8), before.view(torch.uint8))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = fp8_linear_ref(x, both.weight, both.scale)  # rows are independent: the stacked product is exactly the pair
    assert torch.equal(y, torch.cat([fp8_linear_ref(x, wa, sa), fp8_linear_ref(x, wb, sb)], dim=-1))
    assert stacked_fp8(a, b) is both  # made once


def test_formats_that_do_not_stack_are_refused():
    a = _fp8_linear(64, 96, seed=3)
    assert stacked_fp8(_fp8_linear(48, 96, seed=4), a) is None  # 48 rows would split a 32-row scale block
    assert stacked_fp8(a, _fp8_linear(64, 128, seed=5)) is None  # another input width
    assert stacked_fp8(a, Linear(96, 64, "bf16")) is None
