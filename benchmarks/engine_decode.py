"""The engine's decode step, measured through LLMEngine.step() (issue 19): wall time per step, GPU busy time
per step (the union of the kernels' intervals in a torch.profiler trace), and output tok/s.

    python benchmarks/engine_decode.py [--ckpt DIR] [--batches 1,16,64] [--prompt-len 100] [--steps 50]
        [--modes graph,device,legacy] [--sampling greedy|top_p] [--device cuda] [--top-kernels N] [--profile-host N]
        [--grammar off|on|both] [--grammar-threads N]
    python benchmarks/engine_decode.py --real-width --batches 1,6,16,64,256 --modes graph --layer-sum 1,6
    python benchmarks/engine_decode.py --real-width --batches 1 --speculative-tokens 0,1,2,3,4,5

--real-width: instead of a checkpoint, ten layers of DeepSeek-V4.1-Flash's real widths with every layer role
(benchmarks/random_model.py, built on the GPU: ~75 GB; --real-width-layers 8: eight of them, ~58 GiB, which fit an
80 GB GPU; --real-width-layers 6: six, ~51 GiB, which fit one with the DSpark stages for --speculative-tokens);
--layer-sum B: at batch B, each layer's own CUDA-graph time on the decode step's metadata (its Engram mix
included, the Engram row gather left out: the step overlaps it) plus the head's, against the step's model graph
(target: step <= 1.1x the sum).

Per mode and batch: `batch` requests with prompts of --prompt-len random tokens are prefilled, then every
step is a decode step of the whole batch; --steps steps are timed back to back after --warmup (5) steps. Modes:
graph = the decode step on device buffers replayed as CUDA graphs, with async scheduling (the default engine on
CUDA); graph-sync = the same without async scheduling (each step's tokens read before the next is scheduled);
device = the same step run eagerly; legacy = the kernel path's eager step with the host sampler (the
engine before issue 19); shard = graph, with the engine's executor a ShardWorker Ray actor as a serving replica
drives it (needs Ray; its GPU busy time is not traced: another process). Sampling: greedy, or temperature 0.7 + top_p 0.9 (seeded).
--grammar on: every request is constrained by STRING_GRAMMAR, the text of a JSON string that never closes (so no
request ends; its masks take llguidance's token slice, as inside any JSON string: ~126K allowed ids), its masks
computed by the engine each step (GrammarCompiler.masks on grammar.MASK_THREADS threads) while the device runs
the step's forward (engine/core/overlap.py); both: each mode without, then with (rows "<mode>+grammar"), target
<= 1.05x at batch 64.
The printed table's columns: mode, batch, step ms (--steps steps back to back: wall / steps), GPU busy ms per
step, host share of the step ((wall - busy) / wall: the device idle), output tok/s (batch / step).

--speculative-tokens K,..: instead of the modes, speculative decoding (issue 22) with each K (0: the graph mode
above), the checkpoint's or the random model's DSpark stages drafting. K > 0, greedy, drafts on the draft step's
CUDA graphs (engine/core/draft_step.py) and verifies on the verify step's CUDA graphs (engine/core/verify_step.py:
verify rows of K + 1 per request, acceptance, rollback, DSpark context, one graph per (batch, K, context) bucket);
top_p drafts eagerly and runs the eager speculative step. Per K and batch:
step ms, the draft's share of it (the drafter's proposals, synchronised), the verify step's time per step it took
(synchronised; the graph replay, its staging and its read-back), the tokens a step emitted (random weights:
the drafts are nearly all rejected, so about 1), measured tok/s, and tok/s projected at accept lengths 2.8, 3.5 and
5.6 (GSM8K, agentic traces, Baseten's synthetic prompts; issue 22): batch x min(a, K + 1) / step, the verify cost
being what it is whatever is accepted.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_offline import tiny_checkpoint  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.load import load_model  # noqa: E402

STRING_GRAMMAR = 'start: "{\\"text\\": \\"" TEXT\nTEXT: /[^"\\\\\\x00-\\x1F\\x7F<]*/\n'  # Lark; never complete
MODES = {"graph": dict(decode_step=True, cuda_graphs=True),
         "graph-sync": dict(decode_step=True, cuda_graphs=True, async_scheduling=False),
         "device": dict(decode_step=True, cuda_graphs=False),
         "legacy": dict(decode_step=False, cuda_graphs=False),
         "shard": dict(decode_step=True, cuda_graphs=True)}  # graph, driven through a ShardWorker actor


def busy_ms(trace: torch.profiler.profile, steps: int) -> float:
    """GPU busy time per step: the union of every CUDA kernel's [start, end] in the trace (side streams that
    overlap the main stream count once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in trace.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1000 / steps


def top_kernels(trace: torch.profiler.profile, steps: int, n: int) -> str:
    """The n kernels that take the most GPU time per step: name, launches per step, us per step."""
    per: dict[str, list[float]] = {}
    for e in trace.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(e.name[:90], []).append(e.time_range.end - e.time_range.start)
    total = sum(len(v) for v in per.values()) / steps
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:n]
    lines = [f"  {total:.0f} kernels per step; top {n} by time:"]
    lines += [f"  {sum(v) / steps:8.1f} us  {len(v) / steps:5.1f}x  {name}" for name, v in rows]
    return "\n".join(lines)


def layer_sum(engine: LLMEngine, plan) -> tuple[list[float], float, float]:
    """(each layer's graph us, the head's, the step's model graph us) for a decode plan, on its own metadata."""
    from benchmarks.gpu_timing import graph_time_us, replay_time_us
    from engine.core.kernel_ops import OPS, engram_rows
    from engine.kernels.decode_meta import decode_inputs

    step = engine.executor.runner.decode
    kr, cfg = step.runner, step.cfg
    with torch.inference_mode():
        v = step.stage(replace(plan, from_rows=None))
        st = step.device_step(v)
        f = v.fields
        ids, hashes = decode_inputs(f["ids"], f["from_row"], step.last_ids, f["pos"], v.prev, step.engram)
        h = torch.nn.functional.embedding(ids, kr.model.embed.weight).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = torch.zeros(ids.numel(), cfg.hc_mult, dtype=torch.float32, device=ids.device)
        pre[:, 0] = 1.0
        times = []
        for i, layer in enumerate(kr.model.layers):
            phase = st.phase(i, cfg.ced_cut)
            rows = None if layer.engram is None else engram_rows(layer.engram, hashes[:, layer.role.engram_index],
                                                                 ids.device)

            def call(layer=layer, h=h, pre=pre, phase=phase, rows=rows):
                x = h if rows is None else OPS.engram(layer.engram, h, rows)
                return kr.layer_forward(layer, x, pre, st, phase)
            times.append(graph_time_us([call]))
            h, pre = call()
        head = graph_time_us([lambda: kr.head(h, pre)])
        graph = step._graphs[(v.B, v.C)]
        whole = replay_time_us(graph)  # a graph cannot be replayed inside another's capture
    return times, head, whole


def print_host_profile(engine: LLMEngine, steps: int, top: int, sync) -> None:
    """cProfile of `steps` more back-to-back steps: the `top` functions by own time (where the host's share goes; a
    device sync shows as time in a synchronize or a .tolist())."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def measure(engine: LLMEngine, batch: int, args: argparse.Namespace, params: SamplingParams) -> tuple[float, float]:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(0, 120000, (args.prompt_len,), generator=g).tolist(), params)
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):  # back to back: with async scheduling the host's work overlaps the device's
        engine.step()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    if args.profile_host:
        print_host_profile(engine, args.steps, args.profile_host, sync)
    if not hasattr(engine.executor, "runner") or torch.device(args.device).type != "cuda":
        # a shard actor (its kernels run in another process), or the CPU: no GPU trace
        for rid in list(engine.requests):
            engine.abort(rid)
        return step_s * 1000, float("nan")
    n_prof = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        for _ in range(n_prof):
            engine.step()
        torch.cuda.synchronize()
    if args.top_kernels:
        print(top_kernels(trace, n_prof, args.top_kernels), flush=True)
    if batch in args.layer_sum and engine.executor.runner.decode is not None:
        plans = []
        launch = engine.executor.launch
        engine.executor.launch = lambda plan: (plans.append(plan), launch(plan))[1]
        engine.step()
        engine.executor.launch = launch
        times, head, whole = layer_sum(engine, plans[-1])
        print(f"  batch {batch}: layers {' '.join(f'{t:.1f}' for t in times)} us; head {head:.1f} us; "
              f"sum {sum(times) + head:.1f} us; the step's model graph {whole:.1f} us "
              f"({whole / (sum(times) + head):.2f}x the sum)", flush=True)
    for rid in list(engine.requests):
        engine.abort(rid)
    return step_s * 1000, busy_ms(trace, n_prof)


class TimedDrafter:
    """A drafter (engine/core/drafter.py) that adds up its inner drafter's proposal time (synchronised)."""

    def __init__(self, inner, sync):
        self.inner, self.sync, self.seconds = inner, sync, 0.0

    def propose(self, requests):
        self.sync()
        t0 = time.perf_counter()
        out = self.inner.propose(requests)
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out


class TimedVerify:
    """Wraps a VerifyStep's execute (engine/core/verify_step.py: the verify on device buffers, its graph replayed)
    and adds up its time (synchronised) and the steps it took."""

    def __init__(self, step, sync):
        self.inner, self.sync, self.seconds, self.steps = step.execute, sync, 0.0, 0
        step.execute = self

    def __call__(self, plan, drafts):
        self.sync()
        t0 = time.perf_counter()
        out = self.inner(plan, drafts)
        self.sync()
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        return out


ACCEPT_LENGTHS = (2.8, 3.5, 5.6)


def measure_speculative(engine: LLMEngine, batch: int, args: argparse.Namespace, params: SamplingParams
                        ) -> tuple[float, float, float, float, int]:
    """(step ms, draft ms per step, tokens emitted per step, verify ms per verify step on the verify step's graph
    path (nan where none ran), verify steps it took) over --steps steps after the prefill and --warmup."""
    from engine.core.drafter import DSparkDrafter

    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    runner = engine.executor.runner
    timer = None
    if runner.dspark is not None:
        drafter = DSparkDrafter(runner.model, runner.kv, runner.dspark, runner.draft_step)  # greedy: on device
        timer = runner.drafter = TimedDrafter(drafter, sync)
    verify = None if runner.verify is None else TimedVerify(runner.verify, sync)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"s{batch}-{i}", torch.randint(0, 120000, (args.prompt_len,), generator=g).tolist(), params)
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    sync()
    if timer is not None:
        timer.seconds = 0.0
    if verify is not None:
        verify.seconds, verify.steps = 0.0, 0
    tokens, t0 = 0, time.perf_counter()
    for _ in range(args.steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    for rid in list(engine.requests):
        engine.abort(rid)
    draft_ms = 0.0 if timer is None else timer.seconds / args.steps * 1000
    verify_steps = 0 if verify is None else verify.steps
    verify_ms = verify.seconds / verify_steps * 1000 if verify_steps else math.nan
    if verify is not None:
        runner.verify.execute = verify.inner
    return step_s * 1000, draft_ms, tokens / args.steps / batch, verify_ms, verify_steps


def speculative_sweep(model, args: argparse.Namespace, batches: list[int], params: SamplingParams,
                      max_tokens: int) -> None:
    ks = [int(k) for k in args.speculative_tokens.split(",")]
    rows = []
    for K in ks:
        config = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(512, max(batches) * (K + 1)),
                              enable_prefix_caching=False, cache_memory_bytes=args.cache_mib << 20,
                              max_model_len=max_tokens, speculative_tokens=K, **MODES["graph"])
        engine = LLMEngine.local(model, config, progress=True, eos_token_id=-1)
        for batch in batches:
            step_ms, draft_ms, per_step, verify_ms, verify_steps = measure_speculative(engine, batch, args, params)
            rows.append((K, batch, step_ms, draft_ms, verify_ms, per_step))
            print(f"K {K} batch {batch}: {step_ms:.3f} ms/step (draft {draft_ms:.3f}, verify step {verify_ms:.3f} in "
                  f"{verify_steps} of {args.steps} steps), {per_step:.2f} tokens/step per request", flush=True)
        del engine
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "CPU"
    print(f"\n{name}, {args.sampling}, prompt {args.prompt_len}, {args.steps} steps, speculative decoding")
    print("| K | batch | step ms | draft ms | verify ms | tokens/step/request | tok/s | " +
          " | ".join(f"tok/s at accept {a}" for a in ACCEPT_LENGTHS) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(ACCEPT_LENGTHS))
    for K, batch, step_ms, draft_ms, verify_ms, per_step in rows:
        projected = " | ".join(f"{batch * min(a, K + 1) / step_ms * 1000:,.1f}" for a in ACCEPT_LENGTHS)
        print(f"| {K} | {batch} | {step_ms:.3f} | {draft_ms:.3f} | {verify_ms:.3f} | {per_step:.2f} | "
              f"{batch * per_step / step_ms * 1000:,.1f} | {projected} |")


def shard_engine(args: argparse.Namespace, config: EngineConfig) -> LLMEngine:
    """The engine as a replica runs it: its executor a ShardWorker Ray actor (serve_app/shard_worker.py) that loads
    the checkpoint and captures its graphs, each step a Ray call (a launched step: the call sent, read one step
    later). Starts a local Ray once."""
    import ray

    from serve_app.settings import ServeSettings
    from serve_app.shard_worker import make_shard_executor

    assert not args.real_width, "mode shard loads a checkpoint in the actor: not with --real-width"
    if not ray.is_initialized():
        ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    ckpt = Path(args.ckpt) if args.ckpt else tiny_checkpoint()
    settings = ServeSettings(checkpoint=str(ckpt), device=args.device, max_num_seqs=config.max_num_seqs,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             enable_prefix_caching=config.enable_prefix_caching,
                             cache_memory_bytes=config.cache_memory_bytes, max_model_len=config.max_model_len)
    cfg = load_config(ckpt)
    return LLMEngine(cfg, settings.to_engine_config(), make_shard_executor(settings, cfg), eos_token_id=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=None)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="decode steps run before the timed ones")
    p.add_argument("--modes", default="graph,device,legacy")
    p.add_argument("--sampling", choices=("greedy", "top_p"), default="greedy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-mib", type=int, default=2048)
    p.add_argument("--top-kernels", type=int, default=0, help="print the N most costly kernels of each run")
    p.add_argument("--real-width", action="store_true", help="ten random real-width layers instead of --ckpt")
    p.add_argument("--real-width-layers", type=int, choices=(6, 8, 10), default=10,
                   help="8: the real-width roles less the second ratio-2 source (fits an 80 GB GPU); 6: less the "
                   "ratio-2 Reuse, Engram on the ratio-2 source (fits one with the DSpark stages)")
    p.add_argument("--layer-sum", default="", help="batches at which to time each layer's graph")
    p.add_argument("--grammar", choices=("off", "on", "both"), default="off",
                   help="constrain every request by STRING_GRAMMAR (both: measure each mode without and with)")
    p.add_argument("--grammar-threads", type=int, default=None,
                   help="llguidance's threads for the masks (default: GrammarCompiler's, grammar.MASK_THREADS)")
    p.add_argument("--speculative-tokens", default="", metavar="K,..",
                   help="speculative decoding with each K (0 = off) instead of the modes; loads the DSpark stages")
    p.add_argument("--profile-host", type=int, default=0, help="print cProfile's N most costly functions (own time) "
                   "of --steps more steps per batch")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    args.layer_sum = {int(b) for b in args.layer_sum.split(",") if b}
    speculative = bool(args.speculative_tokens)
    max_tokens = args.prompt_len + (args.steps + args.warmup) * (6 if speculative else 1) + 64
    if args.real_width:
        from benchmarks.random_model import random_model, real_width_config

        t0 = time.perf_counter()
        model = random_model(real_width_config(args.real_width_layers, max_tokens), args.device,
                             with_mtp=speculative)
        print(f"random real-width model ({args.real_width_layers} layers) built in {time.perf_counter() - t0:.0f} s, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU", flush=True)
    else:
        model = load_model(Path(args.ckpt) if args.ckpt else tiny_checkpoint(), args.device, with_mtp=speculative,
                           progress=False).model
    params = SamplingParams(max_tokens=10**6, ignore_eos=True) if args.sampling == "greedy" else \
        SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.7, top_p=0.9, seed=1)
    if speculative:
        speculative_sweep(model, args, batches, params, max_tokens)
        return
    grammars = None
    if args.grammar != "off":
        import tempfile

        import llguidance

        from engine.core.grammar import GrammarCompiler
        from engine.core.sampling_params import GrammarSpec
        from engine.tokenizer import load_tokenizer, write_tokenizer_files

        folder = Path(tempfile.mkdtemp())
        write_tokenizer_files(folder)
        tok = load_tokenizer(folder)
        grammars = GrammarCompiler(tok.path.read_text(encoding="utf-8"), tok.eos_id, num_threads=args.grammar_threads)
        constrained = replace(params, grammar=GrammarSpec(llguidance.LLMatcher.grammar_from_lark(STRING_GRAMMAR)))
        print(f"grammar masks on {grammars.num_threads} threads", flush=True)
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.grammar]
    rows = []
    for mode, with_grammar in ((m, g) for m in args.modes.split(",") for g in settings):
        config = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(512, max(batches)),
                              enable_prefix_caching=False, cache_memory_bytes=args.cache_mib << 20,
                              max_model_len=max_tokens, **MODES[mode])
        t0 = time.perf_counter()
        if mode == "shard":
            engine = shard_engine(args, config)
        else:
            engine = LLMEngine.local(model, config, progress=True, eos_token_id=-1)
        engine.grammars = grammars
        label = mode + "+grammar" if with_grammar else mode
        print(f"{label}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for batch in batches:
            step_ms, gpu_ms = measure(engine, batch, args, constrained if with_grammar else params)
            rows.append((label, batch, step_ms, gpu_ms))
            print(f"{label} batch {batch}: {step_ms:.3f} ms/step, GPU busy {gpu_ms:.3f} ms", flush=True)
            if with_grammar:
                print(f"  {engine.stats.num_late_mask_steps} steps so far drew after their forward (late masks)")
        del engine
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "CPU"
    print(f"\n{name}, {args.sampling}, prompt {args.prompt_len}, {args.steps} steps")
    print("| mode | batch | step ms | GPU busy ms | host share | output tok/s |")
    print("|---|---|---|---|---|---|")
    for mode, batch, step_ms, gpu_ms in rows:
        busy, share = ("-", "-") if gpu_ms != gpu_ms else (f"{gpu_ms:.3f}", f"{max(0.0, 1 - gpu_ms / step_ms):.0%}")
        print(f"| {mode} | {batch} | {step_ms:.3f} | {busy} | {share} | {batch / step_ms * 1000:,.0f} |")


if __name__ == "__main__":
    main()
