"""Host time of a prefill chunk's attention metadata (KernelRunner._build_meta: window and entry slots, compressor
plans), per compression ratio, for one request's chunk at the end of a long prompt on the released config.

    python benchmarks/prefill_meta.py [--chunk 16384] [--context 131072] [--device meta|cpu|cuda] [--reps 3]

--device meta counts host work only (tensor ops on the meta device cost nothing); cuda also counts the launches and
copies the host issues. The chunk holds positions context - chunk .. context - 1 of one request whose window and
global blocks are all held (random pool blocks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.engine_config import EngineConfig  # noqa: E402
from engine.core.kernel_layers import KernelRunner, Phase  # noqa: E402
from engine.core.plan import ChunkPlan  # noqa: E402
from engine.core.step_rows import segments  # noqa: E402
from engine.presets import full_config  # noqa: E402

_DEFAULTS = EngineConfig()
SWA_BLOCK, GLOBAL_BLOCK = _DEFAULTS.swa_block_size, _DEFAULTS.global_block_size  # the engine's default layout


def meta_ms(chunk: int, context: int, device: torch.device, reps: int) -> dict[int, float]:
    """Mean host ms of _build_meta per ratio of the released config's layers."""
    cfg = full_config()
    start, end = context - chunk, context
    g = torch.Generator().manual_seed(0)
    first_b = max(start - cfg.window_size + 1, 0) // SWA_BLOCK
    pool = torch.randperm(1 << 20, generator=g).tolist()
    swa_blocks = {b: pool[i] for i, b in enumerate(range(first_b, -(-end // SWA_BLOCK)))}
    global_blocks = pool[-(end // GLOBAL_BLOCK + 1):]
    plan = ChunkPlan(start, end, [1] * chunk, [], True, False, global_blocks, swa_blocks, 0, start, 0, end - 128,
                     end - 128)
    segs = segments([plan])
    runner = SimpleNamespace(cfg=cfg, kv=SimpleNamespace(layout=SimpleNamespace(swa_block_size=SWA_BLOCK,
                                                                                 global_block_size=GLOBAL_BLOCK)),
                             device=device)
    out = {}
    for ratio in sorted({r.ratio for r in cfg.roles[:cfg.n_layers]}):
        KernelRunner._build_meta(runner, [plan], Phase(segs, segs, None, False), ratio)  # warm
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            KernelRunner._build_meta(runner, [plan], Phase(segs, segs, None, False), ratio)
        out[ratio] = (time.perf_counter() - t0) / reps * 1e3
    return out


def main(argv: list[str] | None = None) -> dict[int, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--device", default="meta")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    times = meta_ms(args.chunk, args.context, torch.device(args.device), args.reps)
    print(f"_build_meta host ms, a {args.chunk:,}-token chunk ending at {args.context:,} ({args.device}): "
          + ", ".join(f"ratio {r} {ms:.1f}" for r, ms in times.items()))
    return times


if __name__ == "__main__":
    main()
