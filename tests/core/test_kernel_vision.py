"""The kernel path with images (issue 25), tiny-vision checkpoint: the bf16 vision tower (engine/core/kernel_vision.py)
against the golden tower, the span cache both runners share (engine/core/image_spans.py), the image masks of the
MoE and Engram ops, and the kernel runner with image requests against the golden model.

Tower tolerance. The golden tower rounds to bf16 where the reference's bf16 ops round and is exact between; the bf16
tower rounds at the same points but each op's fp32 inside (GEMM sums, the softmax) lands a bf16 ULP or so off, and
bf16 attention rounds more (the attention probabilities go into the P·V product as bf16, as in flash attention;
the CPU's kernel also approximates exp): measured on the CPU (2026-12-07, the tiny tower: 2 blocks of dim 64, 165
and 198 patches), attention alone is 2.6% of its rows' rms off at worst (the same SDPA on fp32 inputs: 0.14%),
the MLP, RMSNorm and RoPE bitwise; the whole tower's span rows have per-row cosine >= 0.99990 and a relative rms
error <= 1.4%. Bounds: cosine >= TOWER_COS, relative rms error <= TOWER_REL_RMS per row, and the delimiter rows
bitwise (they are the learned vectors). The released tower has 32 blocks: its noise grows with depth
(benchmarks/vision_tower.py --check prints it on the GPU).

End to end: test_runner_kernels.check_engine (its module docstring argues the tolerances) with image requests: the
kernel runner's image rows come from the bf16 tower and the golden's from the float64 one, on top of the text
layers' differences.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.core.image_spans import SpanCache, image_patches, stream_image_mask
from engine.core.kernel_ops import OPS
from engine.core.kernel_vision import VisionTower
from engine.core.plan import ChunkPlan
from engine.core.sampling_params import SamplingParams
from engine.vision.inputs import ImageInput
from engine.vision.layout import ImageGrid
from tests.core.test_decode_step import assert_same_draws, kernel_engine, run
from tests.core.test_engine_images import png, prompt_with
from tests.core.test_runner_kernels import check_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOWER_COS = 0.9995
TOWER_REL_RMS = 0.03


def three_images(cfg) -> list[ImageInput]:
    """Two images of one grid (one batch) and a tall one (another grid)."""
    from engine.vision.image_processing import prepare_image_prompt

    ids = [0, cfg.image_token_id, 5, cfg.image_token_id, 7, cfg.image_token_id]
    _, images = prepare_image_prompt(ids, [png(0), png(1), png(2, 300, 120)], cfg)
    assert images[0].grid == images[1].grid != images[2].grid
    return images


def assert_tower_close(got: torch.Tensor, want: torch.Tensor, grid: ImageGrid, what: str) -> None:
    """Per span row: cosine >= TOWER_COS and ||got - want|| / ||want|| <= TOWER_REL_RMS; the delimiters bitwise."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (grid.num_tokens, want.size(1)), what
    got, want = got.double().cpu(), want.double().cpu()
    cos = F.cosine_similarity(got, want, dim=-1)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    worst = int(rel.argmax())
    print(f"{what}: min cos {cos.min():.6f}, max rel rms {rel.max():.3e} (row {worst})")
    assert cos.min() >= TOWER_COS and rel.max() <= TOWER_REL_RMS, (
        f"{what}: row {worst} rel rms {rel[worst]:.3e}, row {int(cos.argmin())} cos {cos.min():.6f}")
    row = grid.n_llm_w + 1
    delimiters = [0, grid.num_tokens - 1] + [1 + r * row + grid.n_llm_w for r in range(grid.n_llm_h)]
    assert torch.equal(got[delimiters], want[delimiters]), f"{what}: a delimiter row is not the learned vector"


def check_tower(model, device: str) -> None:
    tower = VisionTower(model, device)
    images = three_images(model.cfg)
    batched = tower.span_rows(images)
    alone = [tower.span_rows([im])[0] for im in images]
    for k, im in enumerate(images):
        want = model.span_rows(image_patches(im).to(device), im.grid)
        assert_tower_close(batched[k], want, im.grid, f"image {k} in its batch")
        assert_tower_close(alone[k], want, im.grid, f"image {k} alone")


def test_tower_matches_golden(tiny_vision_model):
    check_tower(tiny_vision_model, "cpu")


def test_tower_takes_the_weights_once(tiny_vision_model):
    """Weights already bf16 on the device are the modules' own storage (no copy per tower or call)."""
    tower = VisionTower(tiny_vision_model, "cpu")
    assert tower.blocks[0].wqkv.data_ptr() == tiny_vision_model.vision.blocks[0].attn.wqkv.weight.data_ptr()
    assert tower.al_w2.data_ptr() == tiny_vision_model.aligner.w2.weight.data_ptr()


# ---- the span cache ------------------------------------------------------------------------------------------------

def _chunk(start: int, end: int, images: tuple[ImageInput, ...]) -> ChunkPlan:
    return ChunkPlan(start, end, [1] * (end - start), [], True, False, [0], {0: 0}, None, 0, 0, 0, 0, 0, images)


def test_span_cache_encodes_an_image_once_across_chunks():
    """A span cut by chunk edges is encoded once; rows come back in stream order; only the last max_kept images stay;
    a chunk that holds only an image's look-back (no patches) encodes nothing."""
    grid = ImageGrid(112, 112, 8, 8, 3, 3)  # 14 span tokens
    patches = [torch.full((64, 3), k, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes() for k in range(3)]
    ims = [ImageInput(2 + 20 * k, grid, patches[k], -1 - k) for k in range(3)]
    calls = []

    def encode(images):
        calls.append([im.key for im in images])
        return [torch.arange(grid.num_tokens, dtype=torch.bfloat16)[:, None] + 100 * image_patches(im)[0, 0]
                for im in images]

    cache = SpanCache(encode, max_kept=2)
    first = [_chunk(0, 10, (ims[0],)), _chunk(0, 5, (ims[1],))]  # image 1 not reached: ends before its span
    assert stream_image_mask(first) == [False] * 2 + [True] * 8 + [False] * 5
    rows = cache.stream_rows(first)
    assert calls == [[-1]] and rows[:, 0].tolist() == list(range(8))
    second = [_chunk(10, 30, (ims[0], ims[1])), _chunk(40, 45, (ims[2],))]
    rows = cache.stream_rows(second)
    assert calls == [[-1], [-2, -3]]
    assert rows[:, 0].tolist() == list(range(8, 14)) + [100 + i for i in range(8)] + [200 + i for i in range(3)]
    assert len(cache) == 2  # image -1 (the least recently used) dropped
    back = ims[2].positions_only()
    assert stream_image_mask([_chunk(56, 57, (back,))]) == [False]
    assert stream_image_mask([_chunk(56, 57, ())]) is None


# ---- the ops' image masks ------------------------------------------------------------------------------------------

def check_moe_bias_vl(model) -> None:
    """moe_kernels with is_image = the golden MoE with its image mask, within a few bf16 ULPs of each row's largest
    value (test_moe bounds it element by element), and bias_vl decides: the same rows routed as text come out
    otherwise. Small activations, so that the router's scores lie within the biases' spread (N(0, 0.05^2) here)."""
    moe = model.layers[0].ffn
    dev = moe.gate.weight.device
    g = torch.Generator().manual_seed(0)
    x = (0.02 * torch.randn(12, model.cfg.dim, generator=g)).bfloat16().to(dev)
    is_image = torch.tensor([True, False] * 6, device=dev)
    got = OPS.moe(x, moe, is_image)
    want = moe(x, is_image)
    as_text = OPS.moe(x, moe, None)
    err = (got.double() - want.double()).abs().amax(-1) / want.double().abs().amax(-1)
    assert err.max() <= 2.0**-6, f"rel err per row {err}"
    assert torch.equal(as_text[~is_image], got[~is_image])
    assert (as_text[is_image] != got[is_image]).any(), "bias_vl changed no image row's experts"


def test_moe_routes_image_rows_with_bias_vl(tiny_vision_model):
    check_moe_bias_vl(tiny_vision_model)


def test_engram_keeps_image_rows(tiny_vision_model):
    """engram_mix with is_image: image rows keep the stream (the golden's gate 0: h + 0 * value = h), the others are
    the unmasked op's."""
    eng = next(layer.engram for layer in tiny_vision_model.layers if layer.engram is not None)
    cfg = tiny_vision_model.cfg
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, cfg.hc_mult, cfg.dim, generator=g).bfloat16()
    rows = torch.randn(6, cfg.n_hash_cols, cfg.engram_head_dim, generator=g).bfloat16()
    is_image = torch.tensor([False, True, True, False, True, False])
    got = OPS.engram(eng, h, rows, is_image)
    assert torch.equal(got[is_image], h[is_image])
    assert torch.equal(got[~is_image], OPS.engram(eng, h, rows)[~is_image])
    assert not torch.equal(got[~is_image], h[~is_image])


# ---- the kernel runner with images ---------------------------------------------------------------------------------

def test_kernel_engine_with_images_matches_golden(tiny_vision_model, monkeypatch):
    """A prompt of 3 text tokens and a small image that ends it, prefill chunked by 9 (a chunk of text and image, then
    the rest of the span), then decode steps that look back at it (Engram), against the golden (check_engine; small:
    here the Triton interpreter takes seconds a row). The MoE and Engram ops of every layer got the step's image rows
    (each span position once per layer)."""
    import engine.core.kernel_layers as kernel_layers

    cfg = tiny_vision_model.cfg
    ids, images = prompt_with(cfg, [png(0, 100, 110)], [])
    assert (images[0].start, images[0].end, len(ids)) == (3, 17, 17)
    seen = {"moe": 0, "engram": 0}

    def spy(name, op, mask_at):  # counts the image rows of each call's is_image argument
        def call(*args):
            mask = args[mask_at] if len(args) > mask_at else None
            seen[name] += 0 if mask is None else int(mask.sum())
            return op(*args)
        return call

    ops = kernel_layers.OPS
    monkeypatch.setattr(kernel_layers, "OPS", replace(ops, moe=spy("moe", ops.moe, 2),
                                                      engram=spy("engram", ops.engram, 3)))
    check_engine(tiny_vision_model, {"end": ids}, False, images={"end": images}, max_chunk_tokens=9)
    assert seen == {"moe": 14 * cfg.n_layers, "engram": 14 * len(cfg.engram_layer_ids)}, seen


# ---- GPU (the device machine) --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_vision_model(tiny_vision_checkpoint):
    from engine.load import load_model

    return load_model(tiny_vision_checkpoint, "cuda", progress=False, with_mtp=False).model


@gpu
@needs_cuda
def test_cuda_tower_matches_golden(cuda_vision_model):
    """cuBLAS bf16 GEMMs and flash attention against the golden tower (float64 on the GPU)."""
    check_tower(cuda_vision_model, "cuda")


@gpu
@needs_cuda
def test_cuda_moe_routes_image_rows_with_bias_vl(cuda_vision_model):
    """At 12 rows on CUDA the MoE takes its decode kernels (route_cuda, the FP4 GEMVs)."""
    check_moe_bias_vl(cuda_vision_model)


@gpu
@needs_cuda
def test_cuda_engine_with_images_matches_golden(cuda_vision_model):
    """The default engine on CUDA (the kernel path, chosen automatically) with image requests against the golden on
    CUDA: an image mid-prompt and one that ends its prompt, chunked by 8 (prompts stay short: test_runner_kernels'
    docstring; check_tower covers batched images)."""
    from engine.core.engine import EngineConfig, LLMEngine

    cfg = cuda_vision_model.cfg
    engine = LLMEngine.local(cuda_vision_model, EngineConfig(max_num_batched_tokens=48, enable_prefix_caching=False,
                                                             bounded_replay=False, max_chunk_tokens=8),
                             eos_token_id=-1)
    assert engine.executor.runner.kernels
    mid_ids, mid = prompt_with(cfg, [png(0, 100, 110)], [4100, 880])
    end_ids, end = prompt_with(cfg, [png(2, 100, 110)], [])
    check_engine(cuda_vision_model, {"mid": mid_ids, "end": end_ids}, False, engine, images={"mid": mid, "end": end})


def image_end_draws(model, decode_step: bool, **config) -> tuple[dict, list[bool]]:
    """A greedy request (with logprobs) whose prompt ends with a small image, so its first decode steps look back
    at image positions (DEAD to Engram): its draws, and per step the decode step ran whether its chunk carried the
    image."""
    ids, images = prompt_with(model.cfg, [png(2, 100, 110)], [])
    engine = kernel_engine(model, decode_step, **config)
    looks = []
    if decode_step:
        step = engine.executor.runner.decode
        launch = step.launch
        step.launch = lambda plan: (looks.append(bool(plan.chunks[0].images)), launch(plan))[1]
    return run(engine, {"a": (ids, SamplingParams(max_tokens=5, logprobs=2), 0)}, {"a": images}), looks


@gpu
@needs_cuda
def test_cuda_decode_graphs_after_an_image(cuda_vision_model):
    """The decode steps right after an image that ends the prompt, replayed from CUDA graphs (the image positions of
    their look-back staged DEAD), draw what the eager kernel path draws."""
    draws, looks = image_end_draws(cuda_vision_model, True, cuda_graphs=True)
    assert_same_draws(draws, image_end_draws(cuda_vision_model, False)[0])
    assert looks[:3] == [True] * 3 and not any(looks[3:]) and len(looks) >= 4, looks  # Engram looks 3 back
