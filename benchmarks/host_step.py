"""The host's share of a decode step: LLMEngine.step() with an executor that returns at once (no model, no device),
so what is timed is the engine's own Python work per step (schedule, plan, launch bookkeeping, reading the tokens
back, stops, outputs). With async scheduling this work overlaps the device's step; it bounds the step from below
once the device is faster.

    python benchmarks/host_step.py [--batches 1,16,64,256] [--prompt-len 100] [--steps 100] [--rounds 7] [--profile N]
        [--stage]

Per batch: `batch` requests of --prompt-len-token prompts (tiny config, prefix cache off; no prefill is computed:
the executor returns at once), 30 warm-up steps, then --rounds
rounds of --steps decode steps; prints the fastest round's ms per step (the machine's other load only adds) and
all rounds. --profile N prints cProfile's N most costly functions (own time) of one more round. --stage: each
decode step is also staged as the kernel path's decode step stages it (DecodeStep.stage, on a random tiny model's
pools on the CPU: the host work of a GPU step but its launches).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.core.decode_buckets import decode_takes  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.core.engine_config import DecodeOptions  # noqa: E402
from engine.core.sampler import SampleOutput  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.core.step_rows import StepOutput  # noqa: E402
from engine.presets import tiny_config  # noqa: E402

TOKEN = 7


def drawn(n: int) -> StepOutput:
    return StepOutput(SampleOutput([TOKEN] * n, [None] * n, [None] * n), {})


class Instant:
    """A launched step whose tokens are there at once."""

    def __init__(self, n: int):
        self.n = n

    def result(self) -> StepOutput:
        return drawn(self.n)


class InstantExecutor:
    """An Executor with no model: every step draws TOKEN for each of its rows; decode steps launch as the
    kernel path's decode step would take them (decode_takes), so async scheduling runs as on a GPU."""

    def __init__(self, options: DecodeOptions):
        self.options = options

    def execute(self, plan) -> StepOutput:
        return drawn(len(plan.samples))

    def launch(self, plan) -> Instant | None:
        return Instant(len(plan.chunks)) if decode_takes(plan, self.options, needs_pending=True) else None


class StagingExecutor(InstantExecutor):
    """InstantExecutor that also stages each decode step as the kernel path's decode step does (DecodeStep.stage:
    the record and the changed block-table entries into the pinned buffer, and their copy; on the CPU), over a
    random tiny model's pools; no forward, no draw."""

    def __init__(self, options: DecodeOptions, layout):
        super().__init__(options)
        from benchmarks.random_model import random_model
        from engine.core.decode_step import DecodeStep
        from engine.core.kernel_layers import KernelRunner
        from engine.core.kv_cache import PagedKVCache

        model = random_model(tiny_config(), "cpu")
        self.step = DecodeStep(KernelRunner(model, PagedKVCache(model.cfg, layout, torch.device("cpu"))), options)

    def launch(self, plan) -> Instant | None:
        if not decode_takes(plan, self.options, needs_pending=True):
            return None
        self.step.stage(plan)
        return Instant(len(plan.chunks))


def engine_for(batch: int, max_model_len: int, stage: bool = False) -> LLMEngine:
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch), enable_prefix_caching=False,
                          max_model_len=max_model_len, cache_memory_bytes=(256 << 20) if stage else (16 << 30))
    options = DecodeOptions(batch, max_model_len)
    make = (lambda layout: StagingExecutor(options, layout)) if stage else (lambda layout: InstantExecutor(options))
    return LLMEngine(tiny_config(), config, make, eos_token_id=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", type=int, default=0)
    p.add_argument("--stage", action="store_true", help="also stage each decode step as DecodeStep.stage does")
    args = p.parse_args()
    print("| batch | host ms per step (fastest round) | rounds |\n|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        engine = engine_for(batch, args.prompt_len + 30 + args.steps * (args.rounds + 1) + 64, args.stage)
        for i in range(batch):
            prompt = [(i + j) % 120000 for j in range(args.prompt_len)]
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10**6, ignore_eos=True))
        while engine.scheduler.waiting or any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running):
            engine.step()
        for _ in range(30):
            engine.step()
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            rounds.append((time.perf_counter() - t0) / args.steps * 1000)
        print(f"| {batch} | {min(rounds):.3f} | {' '.join(f'{r:.3f}' for r in rounds)} |", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                engine.step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
