"""Packed cache records: sizes from spec 4.7 and unpack(pack(x)) bitwise equal to the golden model's QDQ."""

import pytest
import torch

from engine.kernels.cache_records import (fp4_record_bytes, pack_index_k, pack_main_kv, pack_swa, swa_record_bytes,
                                          unpack_index_k, unpack_main_kv, unpack_swa)
from engine.quant import act_quant_qdq, fp4_qdq


def test_record_sizes_match_the_spec():
    assert swa_record_bytes(512) == 528
    assert fp4_record_bytes(512, 16) == 288
    assert fp4_record_bytes(128, 32) == 68


def _awkward_rows(dim: int, rows: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-6, 3, rows).unsqueeze(1)
    x[0] = 0  # all-zero row: the amax clamps pick the scale
    x[1, :16] = 1e4  # saturating block
    x[2] = -0.0
    x[3, ::2] = 0.25  # E2M1 ties
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("dim", [512, 64])
def test_swa_round_trip_is_the_fp8_qdq(dim):
    x = _awkward_rows(dim)
    rec = pack_swa(x)
    assert rec.shape == (37, swa_record_bytes(dim)) and rec.dtype == torch.uint8
    assert torch.equal(unpack_swa(rec, dim).view(torch.int16), act_quant_qdq(x, 32).view(torch.int16))


@pytest.mark.parametrize("dim", [512, 64])
def test_main_kv_round_trip_is_the_nvfp4_qdq(dim):
    x = _awkward_rows(dim)
    rec = pack_main_kv(x)
    assert rec.shape == (37, fp4_record_bytes(dim, 16))
    assert torch.equal(unpack_main_kv(rec, dim).view(torch.int16), fp4_qdq(x, 16, "e4m3").view(torch.int16))


@pytest.mark.parametrize("dim", [128, 32])
def test_index_k_round_trip_is_the_mxfp4_qdq(dim):
    x = _awkward_rows(dim).unflatten(0, (37, 1))  # any leading shape
    rec = pack_index_k(x)
    assert rec.shape == (37, 1, fp4_record_bytes(dim, 32))
    assert torch.equal(unpack_index_k(rec, dim).view(torch.int16), fp4_qdq(x, 32, "ue8m0").view(torch.int16))


def test_record_layout_is_data_then_scales():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 6.0, -3.0  # amax 6 -> UE8M0 scale 2^0 (byte 127); codes 7 and 8|5
    rec = pack_index_k(x)
    assert rec[0, 0].item() == (7 | (13 << 4)) and rec[0, 16].item() == 127
    x = torch.full((1, 32), 1.0, dtype=torch.bfloat16)  # amax 1 -> scale 2^ceil(log2(1/448)) = 2^-8
    rec = pack_swa(x)
    assert rec[0, 32].item() == 127 - 8 and rec[0, 0].item() == 0x78  # 256 in E4M3 = 0 1111 000


def test_wrong_record_size_is_refused():
    with pytest.raises(AssertionError, match="expected 528"):
        unpack_swa(torch.zeros(2, 520, dtype=torch.uint8), 512)
