"""FP8 block-scaled linear: act_quant bitwise, outputs within a stated tolerance of fp8_linear_ref.

Tolerance, per output element, against the oracle `fp8_linear_ref` (exact block sums rounded to fp32,
accumulated in fp32 in K order, then bf16):

    |y - ref| <= 1 bf16 ULP of ref + eps * S,   S[m, n] = Σ_k |qa[m, k] sa| |qw[n, k] sw|

The ULP covers the final rounding landing on the other side of a bf16 tie; eps * S covers the fp32
summation order (the products themselves are exact): eps = 2^-16 on the CPU interpreter (numpy fp32
sums), 2^-14 on the GPU (bf16 tensor-core MMA, fp32 accumulation; measured max err / S is printed by
`benchmarks/kernels.py`: beyond the 1 ULP, <= 1.4e-8 * S). FP8 tensor-core block products (the first
design) measured err up to ~5e-4 * S at M = 1.
"""

import pytest
import torch

from engine.kernels.fp8_linear import (Fp8LinearConfig, dequant_linear, fp8_act_qdq, fp8_act_quant, fp8_linear,
                                       fp8_linear_ref, fp8_weight_bf16, interpreter_config, layer_shapes, pick_config,
                                       split_k_tickets)
from engine.presets import full_config
from engine.quant import act_quant, act_quant_qdq, dequant_fp8_weight, linear, quant_fp8_weight
from tests.kernels.numeric import (FP8_LINEAR_CPU_EPS, FP8_LINEAR_GPU_EPS, assert_fp8_linear_close,
                                   assert_fp8_partial_close, awkward_act_rows, fp8_linear_problem)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_close_names_the_worst_element():
    """The failure message points at the element furthest outside its tolerance (and NaN counts as worst)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    qw, sw = quant_fp8_weight(torch.randn(40, 64, generator=g) * 0.05)
    ref = linear(x, qw, sw)
    y = ref.clone()
    y[1, 7] = ref[1, 7] + 1.0
    y[2, 30] = ref[2, 30] + 4.0
    with pytest.raises(pytest.fail.Exception, match=r"2/120 .*worst \[m=2, n=30\]"):
        assert_fp8_linear_close(y, ref, x, qw, sw, 0.0, "probe")
    y[0, 3] = float("nan")
    with pytest.raises(pytest.fail.Exception, match=r"worst \[m=0, n=3\]"):
        assert_fp8_linear_close(y, ref, x, qw, sw, 0.0, "probe")


def _check_act_quant_bitwise(x: torch.Tensor) -> None:
    q, s = fp8_act_quant(x)
    q_ref, s_ref = act_quant(x.cpu())
    assert s.dtype == torch.float32 and q.dtype == torch.float8_e4m3fn
    assert torch.equal(s.cpu(), s_ref), f"scales differ at {(s.cpu() != s_ref).nonzero()[:5].tolist()}"
    codes, codes_ref = q.cpu().view(torch.uint8), q_ref.view(torch.uint8)
    diff = (codes != codes_ref).nonzero()
    assert diff.numel() == 0, (
        f"{diff.size(0)} of {codes.numel()} codes differ; first at {diff[0].tolist()}: "
        f"x={x[tuple(diff[0])].item()} kernel={codes[tuple(diff[0])].item():#04x} "
        f"ref={codes_ref[tuple(diff[0])].item():#04x}"
    )
    qdq, qdq_ref = fp8_act_qdq(x).cpu().view(torch.int16), act_quant_qdq(x.cpu()).view(torch.int16)
    diff = (qdq != qdq_ref).nonzero()
    assert diff.numel() == 0, f"{diff.size(0)} QDQ values differ; first at {diff[0].tolist()}"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # QDQ of ~bf16-max blocks is inf, as in act_quant_qdq
def test_act_quant_kernel_is_bitwise_act_quant():
    _check_act_quant_bitwise(awkward_act_rows(64))


CPU_SHAPES = [(64, 96), (96, 256), (160, 64)]
CPU_CONFIGS = [None, Fp8LinearConfig(32, 16, 128, 1, 4, 2, True), Fp8LinearConfig(64, 16, 32, 3, 4, 2, True),
               Fp8LinearConfig(64, 32, 64, 2, 4, 2, False)]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", CPU_SHAPES)
@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=["auto", "bn32", "bn64-split3", "prequant-split2"])
def test_fp8_linear_matches_reference(m, n, k, cfg):
    x, qw, sw = fp8_linear_problem(m, n, k)
    y = fp8_linear(x, qw, sw, cfg)
    ref = fp8_linear_ref(x, qw, sw)
    assert_fp8_linear_close(y, ref, x, qw, sw, FP8_LINEAR_CPU_EPS, f"M={m} N={n} K={k} {cfg}")
    # the golden model's float64 product agrees with the oracle as closely
    assert_fp8_linear_close(linear(x, qw, sw), ref, x, qw, sw, FP8_LINEAR_CPU_EPS, f"golden M={m} N={n} K={k}")
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"


@pytest.mark.parametrize("m", [1, 3, 70])
@pytest.mark.parametrize("cfg", [None, Fp8LinearConfig(64, 16, 32, 3, 4, 2, True)], ids=["auto", "split3"])
def test_fp32_out_is_the_sum_before_its_rounding(m, cfg):
    """out_dtype=fp32 (a row-parallel partial): within eps S of the oracle's fp32 accumulator, bf16 of it bit for
    bit the bf16 form of the same launch; and two ranks' K halves summed in fp32 then rounded once agree with the
    whole product as the bf16 form does (1 bf16 ULP + eps S): the kernel path's wo_b at two shards."""
    x, qw, sw = fp8_linear_problem(m, 96, 256)
    y = fp8_linear(x, qw, sw, cfg, out_dtype=torch.float32)
    what = f"M={m} N=96 K=256 {cfg}"
    assert_fp8_partial_close(y, fp8_linear_ref(x, qw, sw, torch.float32), x, qw, sw, FP8_LINEAR_CPU_EPS, what,
                             fp8_linear(x, qw, sw, cfg))
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"
    halves = [fp8_linear(x[:, h:h + 128].contiguous(), qw[:, h:h + 128].contiguous(),
                         sw[:, h // 32:(h + 128) // 32].contiguous(), cfg, out_dtype=torch.float32) for h in (0, 128)]
    summed = (halves[0] + halves[1]).to(torch.bfloat16)
    assert_fp8_linear_close(summed, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_CPU_EPS, f"halves {what}")
    with pytest.raises(AssertionError, match="out_dtype"):
        fp8_linear(x, qw, sw, cfg, out_dtype=torch.float16)


def test_prefill_path_prequantises_x():
    x, qw, sw = fp8_linear_problem(70, 64, 96)  # M > 64: act_quant runs once, the GEMM reads FP8 x
    assert not pick_config(70, 64, 96).fuse_quant
    y = fp8_linear(x, qw, sw, pick_config(70, 64, 96))  # the GPU's shape (off the GPU auto is interpreter_config)
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_CPU_EPS, "M=70 N=64 K=96")


def test_prefill_splits_k_when_the_tiles_fill_less_than_a_wave():
    assert pick_config(512, 1280, 5120).split_k == 3  # wq_a: 40 tiles of 128 x 128 on 132 SMs
    assert pick_config(4096, 1280, 5120).split_k == 1  # 320 tiles
    assert pick_config(512, 5120, 8192).split_k == 1  # wo_b: 160 tiles
    x, qw, sw = fp8_linear_problem(70, 64, 2048)  # one tile: K split in two (>= 1024 per split)
    assert pick_config(70, 64, 2048).split_k == 2
    y = fp8_linear(x, qw, sw, pick_config(70, 64, 2048))
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_CPU_EPS, "M=70 N=64 K=2048 split")
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"



def test_split_k_tickets_are_never_made_inside_a_graph_capture(monkeypatch):
    """A stream's tickets are zeroed when made. Made during a CUDA-graph capture, the zeroing is a node of that one
    graph: the decode step's other graphs captured on the stream started from uninitialised tickets (a tile whose
    ticket is not 0 never writes its output), so bucket 32's graph drew other tokens than the eager step (batch 17 of
    tests/gpu/test_decode_graphs.py). A capturing stream stands in for the GPU's here."""
    import engine.kernels.fp8_linear as fp8_linear_module

    class CapturingStream:
        cuda_stream = 0x5EED

    monkeypatch.setattr(fp8_linear_module, "_TICKETS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CapturingStream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(AssertionError, match="during a CUDA-graph capture"):
        split_k_tickets(torch.device("cuda", 0))
    assert fp8_linear_module._TICKETS == {}

def test_leading_dims_and_empty_rows():
    x, qw, sw = fp8_linear_problem(6, 64, 64)
    y = fp8_linear(x.view(2, 3, 64), qw, sw)
    assert y.shape == (2, 3, 64)
    assert torch.equal(y.view(6, 64), fp8_linear(x, qw, sw))
    assert fp8_linear(x[:0], qw, sw).shape == (0, 64)


def test_contract_is_asserted():
    x, qw, sw = fp8_linear_problem(3, 64, 64)
    with pytest.raises(AssertionError, match="bf16"):
        fp8_linear(x.float(), qw, sw)
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_linear(x, qw.view(torch.uint8), sw)
    with pytest.raises(AssertionError, match="float8_e8m0fnu"):
        fp8_linear(x, qw, sw.float())
    with pytest.raises(AssertionError, match="contiguous"):
        fp8_linear(torch.cat([x, x], 1)[:, ::2], qw, sw)
    with pytest.raises(AssertionError, match="multiple of 32"):
        fp8_linear(x[:, :48].contiguous(), qw[:, :48].contiguous(), sw)
    with pytest.raises(AssertionError, match="needs scale"):
        fp8_linear(x, qw, sw[:1].contiguous())


# --- GPU: real V4.1 shapes -------------------------------------------------------------------------------------

def real_shapes() -> dict[str, tuple[int, int]]:
    """One decoder layer's FP8 linears on the released config."""
    return layer_shapes(full_config())


@gpu
@needs_cuda
def test_act_quant_kernel_is_bitwise_act_quant_gpu():
    _check_act_quant_bitwise(awkward_act_rows(512).cuda())


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 5, 16, 64])
@pytest.mark.parametrize("name", list(real_shapes()))
def test_fp8_linear_real_shapes_gpu(name, m):
    n, k = real_shapes()[name]
    x, qw, sw = fp8_linear_problem(m, n, k, "cuda", seed=m)
    y = fp8_linear(x, qw, sw)
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_GPU_EPS, f"{name} M={m} N={n} K={k}")
    assert torch.equal(y, fp8_linear(x, qw, sw)), "split-K result is not deterministic"
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"


@gpu
@needs_cuda
@pytest.mark.parametrize("path", ["auto", "triton"])
@pytest.mark.parametrize("name,m", [("wq_a", 4096), ("wo_b", 512), ("shared_w2", 333), ("wq_a", 512), ("wkv", 333),
                                    ("wq_b", 128)])
def test_fp8_linear_prefill_gpu(name, m, path):
    """Prefill M: the automatic path (from DEQUANT_MIN_M rows: the weight dequantised, then cuBLAS) and the Triton
    kernel's prefill shape, both within the stated tolerance and deterministic; the fp32 forms within eps S."""
    n, k = real_shapes()[name]
    x, qw, sw = fp8_linear_problem(m, n, k, "cuda")
    cfg = None if path == "auto" else pick_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    y = fp8_linear(x, qw, sw, cfg)
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_GPU_EPS, f"{name} M={m} N={n} K={k}")
    assert torch.equal(y, fp8_linear(x, qw, sw, cfg)), "not deterministic"  # split-K: wq_a / wkv at 512 / 333
    assert not split_k_tickets(x.device).any(), "split-K tickets were not reset"
    y32 = fp8_linear(x, qw, sw, cfg, out_dtype=torch.float32)
    # the Triton launch's fp32 form is its bf16 form before rounding; cuBLAS may pick another kernel per out dtype
    assert_fp8_partial_close(y32, fp8_linear_ref(x, qw, sw, torch.float32), x, qw, sw, FP8_LINEAR_GPU_EPS,
                             f"fp32 {name} M={m}", y if path == "triton" else None)


@pytest.mark.parametrize("n,k", [(64, 96), (70, 256), (300, 1024)])
def test_weight_bf16_is_the_dequantised_weight(n, k):
    """fp8_weight_bf16: every element bit for bit engine.quant's dequantised weight (exact in bf16), partial scale
    blocks (N = 70, 300) included."""
    _, qw, sw = fp8_linear_problem(1, n, k)
    assert torch.equal(fp8_weight_bf16(qw, sw), dequant_fp8_weight(qw, sw).bfloat16())


@pytest.mark.parametrize("m", [1, 70])
def test_dequant_linear_matches_reference(m):
    """The prefill path's math (act QDQ, bf16 weight, one bf16 GEMM with fp32 sums) on the CPU's BLAS: within the
    tolerance of the kernel's; the GPU test runs it through cuBLAS."""
    x, qw, sw = fp8_linear_problem(m, 96, 256)
    y = dequant_linear(x, qw, sw, torch.bfloat16)
    assert_fp8_linear_close(y, fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_CPU_EPS, f"M={m}")


@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (17, 160, 256), (64, 256, 2048), (70, 300, 96)])
def test_interpreter_launches_few_programs(m, n, k):
    """Off the GPU (the interpreter: each op of each program costs Python time) the automatic shape covers up to
    256 rows x 64 tokens in one program, K in steps of up to 512, no split, x quantised inside; and it is what runs."""
    cfg = interpreter_config(m, n, k)
    assert cfg.split_k == 1 and cfg.fuse_quant
    assert cfg.block_n >= min(n, 256) and cfg.block_m >= min(m, 64) and cfg.block_k == 512
    x, qw, sw = fp8_linear_problem(m, n, k)
    assert torch.equal(fp8_linear(x, qw, sw), fp8_linear(x, qw, sw, cfg))
    assert_fp8_linear_close(fp8_linear(x, qw, sw), fp8_linear_ref(x, qw, sw), x, qw, sw, FP8_LINEAR_CPU_EPS,
                            f"M={m} N={n} K={k} {cfg}")
