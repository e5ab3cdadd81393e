"""The kernel path's vision tower (engine/core/kernel_vision.py) on CUDA: time per image at the released shapes, and
the time to first token (TTFT) of a one-image chat through LLMEngine.

    python benchmarks/vision_tower.py [--sizes 544,1344] [--batch 1] [--iters 20] [--check]
        [--ttft-model real-width|tiny-vision|none] [--ttft-runs 5]

Tower: the released vision config (32 blocks, dim 1024, 16 heads of 64, SwiGLU 2816, 3x3 aligner into the LLM's dim)
with random bf16 weights (benchmarks/random_model.py). A square image of each size is planned as the engine plans it
(engine/vision/layout.py: 1344 x 1344 shrinks to fit vision_max_n_token span tokens); its patches are random in
[-1, 1]. Per image: the median of --iters calls, each timed with CUDA events and synchronized, after warm-up; FLOPs
counted from the shapes (GEMMs and attention), as TFLOP/s and % of the bf16 GEMM rate measured in the same run (one
8192^3 torch.matmul). --batch B runs B images of the size at once (per image = time / B).
--check: the tower's span rows against the golden tower (float64 on the GPU) for one 544 x 544 image: per-row cosine
and relative rms error after the 32 blocks.

TTFT: LLMEngine (kernel path, decode step off: one prefill step) on a model with the released tower and a text model
of --ttft-model: real-width (benchmarks/random_model.real_width_config: 10 layers at the release's widths, ~75 GB)
or tiny-vision (the tiny text model). The prompt is the chat template around one image and a question (engine/chat,
the tokenizer, prepare_image_prompt); each run a new random PNG, so neither the runner's span cache nor the prefix
cache hits. Reported: the image's preparation on the host (decode, resize, patches), the engine's TTFT (add_request
to the first token, host wall clock: the step reads its token) and, for comparison, the TTFT of a text-only prompt
of the same length; medians of --ttft-runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import eager_time_us  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.presets import full_config  # noqa: E402
from engine.vision.layout import ImageGrid, plan_image_grid  # noqa: E402


def tower_flops(cfg: ModelConfig, grid: ImageGrid) -> float:
    """GEMM and attention FLOPs of one image through the ViT and the aligner."""
    n, d, inter, p = grid.num_patches, cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size
    per_block = 2 * n * d * (3 * d + d + 2 * inter) + 2 * n * inter * d + 4 * n * n * d
    cells = grid.n_llm_h * grid.n_llm_w
    aligner = 2 * cells * d * cfg.vision_downsample_ratio ** 2 * cfg.dim + 2 * cells * cfg.dim * cfg.dim
    return 2 * n * 3 * p * p * d + cfg.vision_n_layers * per_block + aligner


def gemm_rate() -> float:
    """Measured dense bf16 GEMM rate (FLOP/s): median of 10 8192^3 torch.matmul calls."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (eager_time_us(lambda: a @ b, 10, warmup=3) * 1e-6)


def random_tower(cfg: ModelConfig, device: str = "cuda") -> SimpleNamespace:
    """The golden ViT + aligner and the span delimiters with random bf16 weights on device (what VisionTower reads)."""
    from benchmarks.random_model import randomize
    from engine.model.vision import Aligner, ViT

    with torch.device("meta"):
        vit, aligner = ViT(cfg), Aligner(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    randomize(vit, g)
    randomize(aligner, g)
    delims = {name: (0.5 * torch.randn(cfg.dim, generator=g, device=device)).bfloat16()
              for name in ("image_start", "image_newline", "image_end")}
    return SimpleNamespace(cfg=cfg, vision=vit.eval(), aligner=aligner.eval(), **delims)


def square_image(size: int, cfg: ModelConfig, seed: int):
    """A random PNG of size x size pixels -> (encoded bytes, ImageInput for a prompt of one image)."""
    import numpy as np
    from PIL import Image

    from engine.vision.image_processing import prepare_image_prompt

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    _, [image] = prepare_image_prompt([cfg.image_token_id], [buf.getvalue()], cfg)
    return buf.getvalue(), image


def bench_tower(args: argparse.Namespace, cfg: ModelConfig) -> None:
    from engine.core.kernel_vision import VisionTower

    model = random_tower(cfg)
    tower = VisionTower(model, "cuda")
    rate = gemm_rate()
    print(f"device: {torch.cuda.get_device_name()}; bf16 GEMM rate measured {rate / 1e12:.0f} TFLOP/s\n")
    print("| image px | grid (patches) | span tokens | batch | ms / image | TFLOP / image | TFLOP/s | % GEMM rate |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        grid = plan_image_grid(size, size, cfg)
        patches = (torch.rand(args.batch, grid.num_patches, 3 * cfg.vision_patch_size ** 2, device="cuda") * 2 - 1)
        patches = patches.bfloat16()
        with torch.inference_mode():
            us = eager_time_us(lambda: tower.encode(patches, grid.n_vit_h, grid.n_vit_w), args.iters, warmup=3)
            ms = us / 1e3 / args.batch
        flops = tower_flops(cfg, grid)
        print(f"| {size} x {size} ({grid.best_width} x {grid.best_height}) | {grid.n_vit_h} x {grid.n_vit_w} "
              f"({grid.num_patches}) | {grid.num_tokens} | {args.batch} | {ms:.2f} | {flops / 1e12:.3f} | "
              f"{flops / (ms * 1e-3) / 1e12:.0f} | {100 * flops / (ms * 1e-3) / rate:.0f}% |")
    if args.check:
        check_against_golden(model, tower, cfg)


def check_against_golden(model: SimpleNamespace, tower, cfg: ModelConfig) -> None:
    from engine.core.image_spans import image_patches
    from engine.model.vision import encode_image, span_layout

    _, image = square_image(544, cfg, seed=0)
    with torch.inference_mode():
        fast = tower.span_rows([image])[0].double()
        rows = encode_image(model.vision, model.aligner, image_patches(image).cuda(), image.grid.n_vit_h,
                            image.grid.n_vit_w)  # Transformer.span_rows' two steps
        gold = span_layout(rows, image.grid, model.image_start, model.image_newline, model.image_end).double()
    cos = torch.nn.functional.cosine_similarity(fast, gold, dim=-1)
    rel = (fast - gold).norm(dim=-1) / gold.norm(dim=-1)
    print(f"\n--check (544 x 544, {cfg.vision_n_layers} blocks) vs the golden tower: min row cosine {cos.min():.6f}, "
          f"max row rel rms {rel.max():.3e}, median {rel.median():.3e}")


def ttft_model(kind: str):
    from benchmarks.random_model import random_model, real_width_config

    if kind == "real-width":
        cfg = replace(real_width_config(max_model_len=4096), vision_n_layers=full_config().vision_n_layers)
        return random_model(cfg, "cuda")
    from engine.load import load_model
    from engine.presets import tiny_vision_config
    from engine.tools.make_checkpoint import make_checkpoint

    path = Path(tempfile.mkdtemp()) / "tiny-vision"
    return load_model(make_checkpoint(path, tiny_vision_config(), seed=0), "cuda", progress=False, with_mtp=False).model


def bench_ttft(args: argparse.Namespace) -> None:
    from engine.chat import render_chat_parts
    from engine.core.engine import EngineConfig, LLMEngine
    from engine.core.sampling_params import SamplingParams
    from engine.tokenizer import load_tokenizer, write_tokenizer_files
    from engine.vision.image_processing import prepare_image_prompt

    model = ttft_model(args.ttft_model)
    cfg = model.cfg
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                                             {"type": "text", "text": "What is in this image?"}]}]
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(Path(tmp))
        ids = load_tokenizer(Path(tmp)).encode_parts(render_chat_parts(messages, reasoning_effort="none"))
    engine = LLMEngine.local(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=4096,
                                                 enable_prefix_caching=False, decode_step=False), eos_token_id=-1)

    def first_token(rid: str, prompt: list[int], images) -> float:
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1), images=images)
        while engine.has_unfinished:
            if any(o.new_token_ids for o in engine.step()):
                break
        while engine.has_unfinished:
            engine.step()
        return (time.perf_counter() - t0) * 1e3

    print(f"\nTTFT, one-image chat, text model {args.ttft_model} ({cfg.n_layers} layers, dim {cfg.dim}), "
          f"{cfg.vision_n_layers}-block tower; medians of {args.ttft_runs} runs after a warm-up\n")
    print("| image px | prompt tokens | prepare ms (host) | engine TTFT ms | text-only TTFT ms (same length) |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        prep, ttft, text, n = [], [], [], 0
        for run in range(args.ttft_runs + 1):
            data, _ = square_image(size, cfg, seed=1000 * size + run)
            t0 = time.perf_counter()
            prompt, images = prepare_image_prompt(ids, [data], cfg)
            p_ms = (time.perf_counter() - t0) * 1e3
            t_ms = first_token(f"img{size}-{run}", prompt, images)
            text_ids = torch.randint(0, 120000, (len(prompt),), generator=torch.Generator().manual_seed(run)).tolist()
            x_ms = first_token(f"txt{size}-{run}", text_ids, ())
            if run:  # run 0 warms up (Triton compiles, cuBLAS picks algorithms)
                prep.append(p_ms), ttft.append(t_ms), text.append(x_ms)
            n = len(prompt)
        print(f"| {size} x {size} | {n} | {statistics.median(prep):.1f} | {statistics.median(ttft):.1f} | "
              f"{statistics.median(text):.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[544, 1344],
                   help="square image sides in pixels (default 544,1344)")
    p.add_argument("--batch", type=int, default=1, help="images of one size per tower call (default 1)")
    p.add_argument("--iters", type=int, default=20, help="timed tower calls per size (default 20)")
    p.add_argument("--check", action="store_true", help="the tower's rows against the golden tower (544 x 544)")
    p.add_argument("--ttft-model", choices=["real-width", "tiny-vision", "none"], default="real-width",
                   help="text model of the TTFT runs (none: skip them)")
    p.add_argument("--ttft-runs", type=int, default=5, help="timed TTFT runs per size (default 5)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("vision_tower.py times CUDA: no GPU here")
    bench_tower(args, full_config())
    if args.ttft_model != "none":
        bench_ttft(args)


if __name__ == "__main__":
    main()
