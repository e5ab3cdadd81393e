"""Prefill time per layer and per layer kind through LLMEngine (issue 23: "prefill tokens/s per layer kind", and the
1M-token projection from them).

    python benchmarks/layer_prefill.py [--model real-width|tiny] [--layers 8] [--lengths 8K,32K] [--chunk 8192]
        [--runs 1] [--profile-kernels N]

One request per length (prefix caching off, one output token), prefilled in chunks of --chunk tokens. Every layer
call of the step is timed where it runs (CUDA events around the kernel path's layer_forward, which joins its side
streams before it returns; on the CPU the golden Block's forward, host time). Per length: each layer's total time
over the prompt, its kind (attention mode, compression ratio, Engram, decoder = at or after the CED cut: those run
only the rows bounded replay keeps) and prompt tokens/s; then the released 40-layer config's prefill, each of its
layers costed as the measured layer of the same kind (mode, ratio, decoder or not), on one GPU and split ideally
over 8 (collectives not counted), at the measured length and scaled linearly to 1M tokens. The linear scaling is a
lower bound: attention and the indexer cost more per token as the context grows; measure longer lengths to see how
much.

--runs R: R prefills per length, each layer's fastest reported (the first run of a length may include JIT compiles
of kernel variants at its shapes, which the CUDA events then count).

--profile-kernels N: the last chunk of the longest prompt's last run under torch.profiler, the device synchronized
around each layer so that each kernel falls inside its layer's host window (on the CPU: the layer's top-level ops);
per layer, the window, its kernels' sum, the difference (the device idle while the host works: step metadata, a
compile) and its N costliest kernels. The synchronizations add host gaps to that chunk's layer times.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_ttft import parse_length  # noqa: E402
from benchmarks.random_model import bench_model  # noqa: E402
from engine.config import LayerRole  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.presets import full_config  # noqa: E402

ONE_MILLION = 1 << 20
GPUS = 8
RANGE = "prefill layer "  # the profiler range around each layer call of a profiled chunk


def kind(role: LayerRole) -> tuple[str, int, bool]:
    """What a layer's prefill cost depends on: attention mode, compression ratio, decoder (after the CED cut)."""
    return role.mode, role.ratio, role.is_decoder


def kind_text(k: tuple[str, int, bool]) -> str:
    mode, ratio, decoder = k
    return f"{mode} r{ratio}" + (" (decoder)" if decoder else "")


class LayerClock:
    """Per layer, the time of every call while installed (CUDA events, read after the step; or host time)."""

    def __init__(self, engine: LLMEngine):
        runner = engine.executor.runner
        self.cuda = runner.device.type == "cuda"
        self.spans: dict[int, list] = defaultdict(list)
        self.profiling = False  # set while a profiled chunk runs
        self._undo: list[Callable[[], None]] = []
        if runner.kernels:  # the kernel path: its layer_forward(layer, ...) per layer
            kp = runner._kernel_path
            inner = kp.layer_forward

            def timed(layer, *args, **kwargs):
                if self.profiling:  # every kernel of this layer inside its range: start and end synchronized
                    torch.cuda.synchronize()
                start = self._mark()
                with self._range(layer.role.layer_id):
                    out = inner(layer, *args, **kwargs)
                    if self.profiling:
                        torch.cuda.synchronize()
                self.spans[layer.role.layer_id].append((start, self._mark()))
                return out

            kp.layer_forward = timed
            self._undo.append(lambda: delattr(kp, "layer_forward"))
        else:  # the golden path: each Block's forward
            for block in runner.model.layers:  # (layers do not nest: one start at a time)
                pre = block.register_forward_pre_hook(self._golden_start)
                post = block.register_forward_hook(self._golden_end)
                self._undo += [pre.remove, post.remove]

    def _range(self, layer_id: int):
        return torch.profiler.record_function(f"{RANGE}{layer_id}") if self.profiling else nullcontext()

    def _golden_start(self, block, args) -> None:
        self._open = self._range(block.role.layer_id)
        self._open.__enter__()
        self._start = self._mark()

    def _golden_end(self, block, args, out) -> None:
        self.spans[block.role.layer_id].append((self._start, self._mark()))
        self._open.__exit__(None, None, None)

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def totals_s(self) -> dict[int, float]:
        """Each layer's time summed over its calls, in seconds."""
        if self.cuda:
            torch.cuda.synchronize()
            return {i: sum(a.elapsed_time(b) for a, b in s) / 1e3 for i, s in self.spans.items()}
        return {i: sum(b - a for a, b in s) for i, s in self.spans.items()}

    def remove(self) -> None:
        for undo in self._undo:
            undo()


class Leaf(NamedTuple):
    """A kernel (or, on the CPU, a layer's top-level op) of a profiled chunk: name and [start, end) in us."""
    name: str
    start: float
    end: float


def leaves_by_layer(windows: Iterable[tuple[int, float, float]], leaves: Iterable[Leaf]
                    ) -> dict[int, dict[str, float]]:
    """Per layer, the time (us) of each leaf name that starts inside the layer's window [start, end); leaves in no
    window land under layer -1 (a non-empty -1 means the windows did not cover the chunk's kernels)."""
    windows = sorted(windows, key=lambda w: w[1])
    per: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for leaf in leaves:
        owner = next((i for i, a, b in windows if a <= leaf.start < b), -1)
        per[owner][leaf.name] += leaf.end - leaf.start
    return per


class ChunkProfile(NamedTuple):
    """A profiled chunk: per layer, its host window's length (us: launches, host work and, the device being
    synchronized at both ends, its kernels) and its leaves' time by name (chunk_kernels)."""
    spans: dict[int, float]
    leaves: dict[int, dict[str, float]]


def chunk_kernels(trace: torch.profiler.profile, cuda: bool) -> ChunkProfile:
    """A profiled chunk's leaves per layer: CUDA kernels by time window (not the ranges' own GPU annotations), or
    each layer range's direct CPU ops."""
    ranges = [(int(e.name[len(RANGE):]), e) for e in trace.events()
              if e.name.startswith(RANGE) and e.device_type == torch.autograd.DeviceType.CPU]
    windows = [(i, e.time_range.start, e.time_range.end) for i, e in ranges]
    if cuda:
        leaves = [Leaf(e.name[:80], e.time_range.start, e.time_range.end) for e in trace.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(RANGE)]
    else:
        leaves = [Leaf(c.name[:80], c.time_range.start, c.time_range.end) for _, e in ranges for c in e.cpu_children]
    spans: dict[int, float] = defaultdict(float)
    for i, a, b in windows:
        spans[i] += b - a
    return ChunkProfile(dict(spans), leaves_by_layer(windows, leaves))


def kernel_report(profile: ChunkProfile, roles, top: int) -> str:
    """Per layer: its window, its kernels' sum (the rest of the window: the device idle, waiting for the host), and
    its costliest kernels."""
    lines = ["| layer | kind | window ms | kernels ms | idle ms | its costliest kernels (ms) |",
             "|---|---|---|---|---|---|"]
    for i, names in sorted(profile.leaves.items()):
        ranked = sorted(names.items(), key=lambda kv: -kv[1])[:top]
        what = "; ".join(f"{n} {us / 1e3:.2f}" for n, us in ranked)
        label = kind_text(kind(roles[i])) if i >= 0 else "outside every layer"
        busy, span = sum(names.values()) / 1e3, profile.spans.get(i, 0.0) / 1e3
        lines.append(f"| {i} | {label} | {span:.1f} | {busy:.1f} | {max(span - busy, 0.0) if i >= 0 else 0.0:.1f} | "
                     f"{what} |")
    return "\n".join(lines)


def prefill_layers(engine: LLMEngine, prompt: list[int], rid: str, profile_last: bool = False
                   ) -> tuple[dict[int, float], ChunkProfile | None, float]:
    """Each layer's time over one request's prefill (to its first token); with profile_last, also the last chunk's
    kernels per layer (chunk_kernels); and the wall time from add_request to the first token (TTFT, host work
    between and around the layers included)."""
    clock = LayerClock(engine)
    chunk = engine.config.max_num_batched_tokens
    steps = -(-len(prompt) // chunk)  # one request, one chunk a step; the last one samples the first token
    kernels: ChunkProfile | None = None
    start = time.perf_counter()
    try:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        last, done = None, 0
        while engine.has_unfinished:
            profiled = profile_last and done == steps - 1
            if profiled:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                               if clock.cuda else [])
                with torch.profiler.profile(activities=acts) as trace:
                    clock.profiling = True
                    try:
                        outs = engine.step()
                    finally:
                        clock.profiling = False
                kernels = chunk_kernels(trace, clock.cuda)
            else:
                outs = engine.step()
            done += 1
            last = next((o for o in outs if o.request_id == rid), last)
        wall_s = time.perf_counter() - start  # (the step that returns the first token synchronizes)
        totals = clock.totals_s()
    finally:
        clock.remove()
    if not totals:  # nothing ran through the layers: say why rather than print an empty table
        raise RuntimeError(f"no layer ran for request {rid} ({len(prompt)} tokens): its last output {last}, "
                           f"runner {type(engine.executor.runner).__name__} kernels={engine.executor.runner.kernels}")
    if profile_last and (kernels is None or not kernels.spans):
        raise RuntimeError(f"the profiled chunk of request {rid} recorded no layer range ({steps} steps expected)")
    return totals, kernels, wall_s


def released_projection(measured: dict[tuple, float]) -> tuple[float, list[str]]:
    """The released config's prefill on one GPU from the measured seconds per kind (each kind's mean layer, for the
    prompt they were measured on), and the kinds it has that were not measured."""
    cfg = full_config()
    total, missing = 0.0, []
    for role in cfg.roles[:cfg.n_layers]:  # (not the DSpark stages)
        k = kind(role)
        if k in measured:
            total += measured[k]
        elif kind_text(k) not in missing:
            missing.append(kind_text(k))
    return total, missing


def main(argv: list[str] | None = None) -> dict[int, dict[tuple, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["real-width", "tiny"], default="real-width",
                   help="real-width: real_width_config(--layers) on the GPU; tiny: the tiny config (CPU works)")
    p.add_argument("--layers", type=int, default=8, help="real_width_config's role order (6, 8 or 10 layers)")
    p.add_argument("--lengths", default="8K,32K")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens: prefill chunk size")
    p.add_argument("--cache-mib", type=int, default=4096)
    p.add_argument("--runs", type=int, default=1, help="prefills per length (fresh random prompts); each layer's "
                   "fastest is reported: the first may include JIT compiles at the length's shapes")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="profile the longest prompt's last chunk: each layer's N costliest kernels")
    args = p.parse_args(argv)
    lengths = [parse_length(t) for t in args.lengths.split(",")]
    t0 = time.perf_counter()
    model = bench_model(args.model, args.layers, max(lengths) + 64)
    print(f"random {args.model} model ({model.cfg.n_layers} layers) built in {time.perf_counter() - t0:.0f} s",
          flush=True)
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                          cache_memory_bytes=args.cache_mib << 20, max_model_len=max(lengths) + 64)
    engine = LLMEngine.local(model, config, eos_token_id=-1)
    g = torch.Generator().manual_seed(0)
    prefill_layers(engine, torch.randint(0, 120000, (min(args.chunk, max(lengths)),), generator=g).tolist(), "warm")
    print("TTFT below: wall time from add_request to the first token (host work between the layers included); "
          "the layers' sum: their CUDA-event times", flush=True)
    longest = max(lengths)
    roles = model.cfg.roles
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    by_length = {}
    for n in lengths:
        profile = args.profile_kernels > 0 and n == longest
        per_layer: dict[int, float] = {}
        ttfts: list[tuple[float, float]] = []  # per unprofiled run: (TTFT, the layers' sum)
        for run in range(args.runs):  # the profiled chunk only in the last run
            profiled = profile and run == args.runs - 1
            times, kernels, wall_s = prefill_layers(engine, torch.randint(0, 120000, (n,), generator=g).tolist(),
                                                    f"r{n}-{run}", profile_last=profiled)
            per_layer = {i: min(s, per_layer.get(i, s)) for i, s in times.items()}
            if not profiled:
                ttfts.append((wall_s, sum(times.values())))
        kinds: dict[tuple, list[float]] = defaultdict(list)
        print(f"\n{device}, {args.model} model, a {n:,}-token prompt in chunks of {args.chunk}"
              + (f", fastest of {args.runs} runs per layer" if args.runs > 1 else ""))
        print("| layer | kind | Engram | ms over the prompt | prompt tok/s through it |")
        print("|---|---|---|---|---|")
        for i, s in sorted(per_layer.items()):
            role = roles[i]
            kinds[kind(role)].append(s)
            print(f"| {i} | {kind_text(kind(role))} | {'yes' if role.has_engram else ''} | {s * 1e3:.1f} | "
                  f"{n / s:,.0f} |")
        measured = {k: sum(v) / len(v) for k, v in kinds.items()}
        by_length[n] = measured
        one_gpu, missing = released_projection(measured)
        print("\nper kind (mean layer): " + "; ".join(f"{kind_text(k)} {s * 1e3:.1f} ms ({n / s:,.0f} tok/s)"
                                                    for k, s in sorted(measured.items())))
        print(f"released 40 layers, {n:,} tokens: {one_gpu:.2f} s on one GPU, {one_gpu / GPUS:.2f} s over {GPUS} "
              f"(ideal split); x {ONE_MILLION / n:.0f} to 1M tokens: >= {one_gpu / GPUS * ONE_MILLION / n:.1f} s over "
              f"{GPUS} (Baseten: 11.7 s on 8xB300)" + (f"; not measured, left out: {', '.join(missing)}"
                                                       if missing else ""))
        if ttfts:
            wall_s, layers_s = min(ttfts)
            print(f"TTFT {wall_s * 1e3:,.1f} ms (fastest unprofiled run of {len(ttfts)}): the layers' sum "
                  f"{layers_s * 1e3:,.1f} ms, the rest {(wall_s - layers_s) * 1e3:,.1f} ms (embedding, head, host work "
                  "the device waited for)")
        if profile:
            print(f"\nthe last chunk of the {n:,}-token prompt, under the profiler (layers synchronized):")
            print(kernel_report(kernels, roles, args.profile_kernels), flush=True)
    engine.close()
    return by_length


if __name__ == "__main__":
    main()
