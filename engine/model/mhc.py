"""Single-pass manifold-constrained hyper-connections (mHC): the 4-copy residual stream (spec 4.2)."""

from __future__ import annotations

import torch


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes fp32 [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc, hc] (all fp32).

    comb is made (approximately) doubly stochastic: softmax over rows + eps, then a column
    normalisation, then iters-1 rounds of row then column normalisation (ends on columns).
    """
    m = mixes.double()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre.float(), post.float(), comb.float()


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
             hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B,S,hc,D] -> (pre, post, comb) from one projection of the flattened, RMS-normalised stream."""
    flat = x.flatten(2).double()  # [B,S,hc*D]
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = (flat @ fn.double().T) * rstd
    return hc_split_sinkhorn(mixes.float(), scale.float(), base.float(), hc, iters, hc_eps)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the copies: [B,S,hc,D] x [B,S,hc] -> [B,S,D] (exact sums in float64, rounded to x's dtype)."""
    return torch.sum(pre.double().unsqueeze(-1) * x.double(), dim=2).to(x.dtype)


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output back: out[k] = post[k]*y + sum_j comb[j,k]*residual[j] -> [B,S,hc,D] y.dtype
    (float64 sums rounded once: the fp32 reference up to summation order, independent of the batch shape)."""
    mixed = torch.sum(comb.double().unsqueeze(-1) * residual.double().unsqueeze(-2), dim=2)
    return (post.double().unsqueeze(-1) * y.double().unsqueeze(-2) + mixed).to(y.dtype)


def identity_pre_mix(batch: int, seqlen: int, hc: int, device: torch.device) -> torch.Tensor:
    """The first block's attention collapse takes copy 0: one-hot fp32 [B,S,hc]."""
    pre = torch.zeros(batch, seqlen, hc, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    return pre
