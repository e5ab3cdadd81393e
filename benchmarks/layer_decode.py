"""One whole decoder layer of DeepSeek-V4.1-Flash at real shapes, decode and 6-token verify, through the
runner's kernel path (engine/core/kernel_layers.py), captured in a CUDA graph.

    python benchmarks/layer_decode.py [--contexts 8192,65536] [--layers 20,21,8,14] [--tokens 1,6] [--no-golden]

Per layer (random weights in the checkpoint's formats: FP8 dense, FP4 routed experts, bf16 norms and
router) and per (context, tokens): the layer's mHC mixes, norms, attention (window KV write, compressor
and global KV write on KV sources, indexer + top-k on index sources, sparse attention over the paged
pools) and MoE (router, the 6 routed experts of each token + the shared expert), as
`KernelRunner.layer_forward` runs it inside a step, with one request holding `context` tokens of cache.

Printed: time per layer in a CUDA graph (median replay), eagerly (same calls, no graph), and the golden
torch path (engine/core/runner.py's golden modules, float64) for reference; the layer's minimum bytes
(every weight read once incl. scales, routed experts only those picked, the window and top-k KV records,
the index-key records scanned, the stream in and out) / the copy bandwidth measured in the run = the
roofline time, and graph time / roofline (target <= 1.5x, issue 7).

Layer kinds (real config): 20 = Full, ratio 1, KV + index source, candidate source, CED cut;
21 = Reuse of 20; 8 = ratio-2 KV + index source (compressor with pending slot); 14 = the same plus
Engram (its 24 rows per token gathered by the GPU from a pinned host table: here 2^20 random rows
instead of the real 384M, which changes nothing per token).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import copy_bandwidth, graph_time_us  # noqa: E402
from benchmarks.random_model import randomize  # noqa: E402
from engine.core.cache_manager import CacheLayout  # noqa: E402
from engine.core.kernel_layers import KernelRunner  # noqa: E402
from engine.core.kernel_ops import OPS, engram_rows, op_backends  # noqa: E402
from engine.core.kv_cache import PagedKVCache  # noqa: E402
from engine.core.plan import ChunkPlan, StepPlan  # noqa: E402
from engine.core.runner import ModelRunner  # noqa: E402
from engine.core.step_rows import Segment  # noqa: E402
from engine.model.block import Block  # noqa: E402
from engine.model.engram import EngramEmbedding  # noqa: E402
from engine.model.cache import StepShared  # noqa: E402
from engine.presets import full_config  # noqa: E402

GLOBAL_BLOCK, SWA_BLOCK = 64, 16
ENGRAM_ROWS = 1 << 20


def build_layer(cfg, layer_id: int, device: str = "cuda") -> Block:
    """A decoder layer with random weights in the checkpoint's storage formats, on `device`."""
    with torch.device("meta"):
        blk = Block(cfg, cfg.layer_role(layer_id))
    randomize(blk, torch.Generator(device=device).manual_seed(layer_id), engram_rows=ENGRAM_ROWS)
    return blk


def fill_pools(kv: PagedKVCache, cfg) -> None:
    """Random valid records: moderate FP8 codes, E8M0 scales near 1, E4M3 main-KV scales near 1/8."""
    d, di = cfg.head_dim, cfg.index_head_dim
    for pool in kv.swa:
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, device=pool.device))
        pool[..., :d] &= 0x77
        pool[..., d:] = torch.randint(120, 131, pool[..., d:].shape, dtype=torch.uint8, device=pool.device)
    for pool in kv.main_kv.values():
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, device=pool.device))
        pool[..., d // 2:] = torch.randint(0x30, 0x40, pool[..., d // 2:].shape, dtype=torch.uint8, device=pool.device)
    for pool in kv.index_k.values():
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, device=pool.device))
        pool[..., di // 2:] = torch.randint(120, 131, pool[..., di // 2:].shape, dtype=torch.uint8, device=pool.device)


def make_step(cfg, context: int, tokens: int, device: str = "cuda") -> tuple[PagedKVCache, StepPlan]:
    """One request holding `context` positions of cache, computing positions context .. context+tokens-1."""
    end = context + tokens
    n_global = -(-end // GLOBAL_BLOCK)
    first_swa = max(0, context - cfg.window_size) // SWA_BLOCK
    swa_blocks = {b: i for i, b in enumerate(range(first_swa, -(-end // SWA_BLOCK)))}
    layout = CacheLayout(GLOBAL_BLOCK, SWA_BLOCK, cfg.window_size, n_global, len(swa_blocks), 1, 0)
    kv = PagedKVCache(cfg, layout, device)
    fill_pools(kv, cfg)
    ids = torch.randint(0, cfg.vocab_size, (tokens + 3,)).tolist()
    chunk = ChunkPlan(context, end, ids[3:], ids[:3], sample=True, keep_logits=False,
                      global_blocks=list(range(n_global)), swa_blocks=swa_blocks, pending_slot=0,
                      global_from=context, swa_floor=0, decoder_from=context, decoder_floor=0)
    return kv, StepPlan([chunk])


def layer_bytes(blk: Block, x: torch.Tensor, cfg, context: int, tokens: int) -> tuple[int, int]:
    """(minimum bytes of one layer call, routed experts picked). Weights once (routed: the picked ones),
    KV records read (window rows, top-k entries, index keys scanned with their slots), stream in/out."""
    role = blk.role
    per_row = {id(m) for e in blk.ffn.experts for m in e.modules()}  # routed experts: the picked ones, below
    per_row |= {id(m) for m in blk.modules() if isinstance(m, EngramEmbedding)}  # its rows, below
    nbytes = sum(b.numel() * b.element_size() for m in blk.modules() if id(m) not in per_row
                 for b in m.buffers(recurse=False))
    scores = torch.nn.functional.softplus(x.float() @ blk.ffn.gate.weight.float().T).sqrt()
    picked = (scores + blk.ffn.gate.bias).topk(blk.ffn.gate.topk, dim=-1).indices.unique().numel()
    e0 = blk.ffn.experts[0]
    nbytes += picked * sum(b.numel() * b.element_size() for b in e0.buffers())
    nbytes += (cfg.window_size + tokens - 1) * cfg.swa_entry_bytes + tokens * cfg.swa_entry_bytes  # read + write
    if role.ratio > 0:
        entries = (context + tokens) // role.ratio
        nbytes += min(tokens * cfg.index_topk, entries) * cfg.main_kv_entry_bytes
        if role.is_index_source:
            nbytes += entries * (cfg.index_k_entry_bytes + 4)
    nbytes += 2 * tokens * cfg.hc_mult * cfg.dim * 2
    if blk.engram is not None:  # its rows (over PCIe from the host table)
        nbytes += tokens * cfg.n_hash_cols * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    return nbytes, picked


def time_graph(fn, replays: int = 20) -> float:
    """One layer call captured in a CUDA graph: median replay time (us)."""
    return graph_time_us([fn], replays)


def time_eager(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def golden_call(blocks: dict[int, Block], layer_id: int, kv: PagedKVCache, cfg, plan: StepPlan, h: torch.Tensor,
                pre: torch.Tensor, hash_ids: torch.Tensor):
    """The golden path's layer: Block.forward with ModelRunner._attention (float64 modules). A Reuse
    layer's index source runs once first (untimed) to publish its top-k."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.model, runner.kv, runner.cfg, runner.device = None, kv, cfg, h.device
    runner.kernels, runner._kernel_path = False, None
    c = plan.chunks[0]
    segs = [Segment(0, c.start, c.end, 0)]
    shared = [StepShared()]

    def call(blk: Block = blocks[layer_id]):
        decoder = blk.role.layer_id >= cfg.ced_cut
        attend = lambda x: runner._attention(blk.attn, x, plan.chunks, segs, segs, shared, decoder)  # noqa: E731
        x = h.unsqueeze(0)
        if blk.engram is not None:
            x = blk.engram(x, hash_ids.unsqueeze(0))
        return blk(x, pre.unsqueeze(0), attend, 0)
    source = cfg.layer_role(layer_id).index_source
    if source not in (None, layer_id):
        call(blocks[source])
    return call


def bench(copy_bw: float, contexts=(8192, 65536), layers=(20, 21, 8, 14), tokens=(1, 6), golden: bool = True) -> None:
    cfg = full_config()
    print(f"\n## one decoder layer (real shapes, random weights) through engine/core/kernel_layers.py; "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print("op backends: " + ", ".join(f"{k}={v}" for k, v in op_backends().items()) + "\n")
    head = ("| layer | kind | context | tokens | experts | graph us | eager us | golden us | bytes | roofline us |"
            " graph / roofline | TB/s |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    blocks = {}
    for layer_id in sorted(set(layers) | ({cfg.layer_role(l).index_source for l in layers} - {None})):
        blocks[layer_id] = build_layer(cfg, layer_id)
    for context in contexts:
        for m in tokens:
            kv, plan = make_step(cfg, context, m)
            runner = KernelRunner(SimpleNamespace(cfg=cfg, engram_tables=None), kv)
            step = runner.prepare(plan)
            h = torch.randn(m, cfg.hc_mult, cfg.dim, device="cuda").bfloat16()
            pre = torch.softmax(torch.randn(m, cfg.hc_mult, device="cuda"), -1)
            hash_ids = torch.randint(0, ENGRAM_ROWS, (m, cfg.n_hash_cols), device="cuda")
            with torch.inference_mode():
                for src in sorted(blocks):  # index sources publish the top-k their Reuse layers read
                    if src not in layers:
                        runner.layer_forward(blocks[src], h, pre, step, step.phase(src, cfg.ced_cut))
                for layer_id in layers:
                    blk, role = blocks[layer_id], cfg.layer_role(layer_id)
                    phase = step.phase(layer_id, cfg.ced_cut)
                    def fn(blk=blk, phase=phase):
                        x = h
                        if blk.engram is not None:  # its rows gathered by the GPU from the pinned host table
                            x = OPS.engram(blk.engram, h, engram_rows(blk.engram, hash_ids, h.device))
                        return runner.layer_forward(blk, x, pre, step, phase)
                    eager = time_eager(fn)
                    try:
                        graph = time_graph(fn)
                    except Exception as e:  # noqa: BLE001 - reported: a wrapper that is not graph-safe
                        print(f"  layer {layer_id}: capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        graph = math.nan
                    fn()  # eager again: what it publishes (top-k) lives outside the graph's pool
                    gold = math.nan
                    if golden:
                        gold = time_eager(golden_call(blocks, layer_id, kv, cfg, plan, h, pre, hash_ids), reps=2)
                    x = torch.randn(m, cfg.dim, device="cuda").bfloat16()
                    nbytes, picked = layer_bytes(blk, x, cfg, context, m)
                    roof = nbytes / copy_bw * 1e6
                    print(f"| {layer_id} | {role.mode} r{role.ratio} | {context:,} | {m} | {picked} | {graph:.1f} | "
                          f"{eager:.1f} | {gold:.0f} | {nbytes / 1e6:.1f} MB | {roof:.1f} | {graph / roof:.2f}x | "
                          f"{nbytes / graph / 1e6:.2f} |", flush=True)
            del kv, runner, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,65536")
    parser.add_argument("--layers", default="20,21,8,14")
    parser.add_argument("--tokens", default="1,6")
    parser.add_argument("--no-golden", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "benchmarks/layer_decode.py needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    bench(copy_bandwidth(), ints(args.contexts), ints(args.layers), ints(args.tokens), not args.no_golden)


if __name__ == "__main__":
    main()
