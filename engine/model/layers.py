"""Weight-holding building blocks whose attribute names are the checkpoint's tensor names.

Model parallelism lives here, as in DeepSeek's reference: `ColumnParallelLinear` (output features split over
the ranks), `RowParallelLinear` (input features split, partial products summed over the ranks) and the
vocab-parallel `ParallelHead`. Everything else is written as if on one device, with n_local_* sizes. A
row-parallel product is summed over the ranks in float64 before its one rounding, so N shards compute what
one shard computes up to float64 summation order.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import SINGLE, ShardSpec, all_gather, all_reduce_sum
from engine.quant import dequant_fp8_weight, exact_matmul, linear, linear_f64, round_product

WeightFormat = Literal["fp8", "fp4", "bf16", "fp32"]


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with fp32 output, computed exactly (batch-size independent; see quant.exact_matmul)."""
    return exact_matmul(x.reshape(-1, x.size(-1)), weight.T).view(*x.shape[:-1], weight.size(0))


def register(module: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Checkpoint tensors are persistent buffers: any dtype, loaded by name with load_state_dict."""
    module.register_buffer(name, torch.empty(shape, dtype=dtype))


class Linear(nn.Module):
    """y = x W^T with W stored as in the checkpoint: FP8 E4M3 + E8M0 per 32x32 block, packed FP4 E2M1 +
    E8M0 per 32 along `in`, or bf16. `compute` = "fp32" promotes a bf16 checkpoint weight to fp32 math
    (the reference does this for the ratio-2 compressor, the gate, the head and the confidence head)."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat,
                 compute: Literal["native", "fp32"] = "native"):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.compute = in_features, out_features, fmt, compute
        if fmt == "fp8":
            register(self, "weight", (out_features, in_features), torch.float8_e4m3fn)
            register(self, "scale", (-(-out_features // 32), -(-in_features // 32)), torch.float8_e8m0fnu)
        elif fmt == "fp4":
            register(self, "weight", (out_features, in_features // 2), torch.uint8)
            register(self, "scale", (out_features, in_features // 32), torch.float8_e8m0fnu)
        else:
            register(self, "weight", (out_features, in_features), torch.bfloat16 if fmt == "bf16" else torch.float32)
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute == "fp32":
            return fp32_linear(x, self.weight)
        return linear(x, self.weight, self.scale)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (exact for FP8 x 2^k in bf16)."""
        if self.fmt == "fp8":
            return dequant_fp8_weight(self.weight, self.scale).to(dtype)
        return self.weight.to(dtype)


class ColumnParallelLinear(Linear):
    """Output features split over the ranks: this rank holds rows rank*out/N .. of the checkpoint weight
    and returns its slice of y (out_features is the local count)."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, shard: ShardSpec = SINGLE,
                 dim: str = "out_features"):
        super().__init__(in_features, shard.split(out_features, dim), fmt)


class RowParallelLinear(Linear):
    """Input features split over the ranks: this rank holds columns rank*in/N .. of the checkpoint weight,
    takes its slice of x and returns the whole y: the float64 partial products of every rank summed, then
    rounded once (in_features is the local count)."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, shard: ShardSpec = SINGLE,
                 dim: str = "in_features"):
        super().__init__(shard.split(in_features, dim), out_features, fmt)
        self.shard = shard

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of x W^T, float64 [..., out], unrounded (to be summed over the ranks)."""
        return linear_f64(x, self.weight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return round_product(all_reduce_sum(self.partial(x), self.shard), self.weight)


class RMSNorm(nn.Module):
    """y = (w * (x * rsqrt(mean(x^2) + eps))), the reference's fp32 math done in float64, cast to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        register(self, "weight", (dim,), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.double()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.double() * xf).to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        register(self, "weight", (vocab_size, dim), torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ParallelHead(nn.Module):
    """The vocab-parallel head: bf16 in the checkpoint, fp32 math (the reference keeps it fp32): fp32 logits.
    This rank holds vocabulary rows rank*V/N ..; the logits of every rank are gathered (all-gather, as
    the reference does), so each row equals the one-shard row bit for bit and sampling stays exact.

    Computed exactly in float64 (see quant.exact_matmul); the float64 copy of the weight is made once
    per weight tensor (re-made when the weight is replaced or moved)."""

    def __init__(self, vocab_size: int, dim: int, shard: ShardSpec = SINGLE):
        super().__init__()
        self.shard = shard
        register(self, "weight", (shard.split(vocab_size, "vocab_size"), dim), torch.bfloat16)
        self._fp32: tuple[torch.Tensor, torch.Tensor] | None = None  # (source weight, fp32 copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> fp32 [..., vocab_size] (the whole vocabulary, on every rank)."""
        if self._fp32 is None or self._fp32[0] is not self.weight:
            self._fp32 = (self.weight, self.weight.double())
        return all_gather((x.double() @ self._fp32[1].T).float(), self.shard, dim=-1)
