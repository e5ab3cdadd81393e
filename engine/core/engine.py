"""The engine loop: add_request / abort / step over the scheduler, the batched runner and the sampler.

A step is schedule -> execute -> advance -> sample: the scheduler plans which positions each request
computes, the runner computes them over the paged pools, and every request whose computed positions
reached its tokens gets its next token (teacher-forced ids win over sampled ones while they last).
With speculative decoding a decoding request's chunk also verifies drafts, and it gets every token the
runner accepted (engine/core/speculative.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.config import ModelConfig
from engine.core import kv_blocks
from engine.core.cache_manager import CacheLayout, KVCacheManager, PendingImport
from engine.core.drafter import Drafter
from engine.core.engine_config import DecodeOptions, EngineConfig, check_speculative, decode_options
from engine.core.engine_config import kernels_for
from engine.core.grammar import GrammarCompiler, GrammarError
from engine.core.kv_blocks import ExportedPrefix, PrefixImportError
from engine.core.kv_cache import PagedKVCache, size_layout
from engine.core.kv_import import BlockImporter, BlockReader
from engine.core.overlap import FailedLaunch, InFlight, can_overlap, from_rows
from engine.core.plan import DraftPolicy, SampleSpec, StepPlan, VerifySpec, plan_step
from engine.core.prefix_hash import fingerprint
from engine.core.request import PENDING_TOKEN, FinishReason, Request, RequestStats, TokenLogprob
from engine.core.runner import ModelRunner
from engine.core.step_rows import StepOutput
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.model.transformer import Transformer
from engine.vision.inputs import ImageInput

_SEED_STEP = 0x9E3779B97F4A7C15


class RequestError(ValueError):
    """A request the engine cannot take (the message names what is wrong); nothing was queued."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (one of the n choices of a group)."""

    request_id: str
    group_id: str
    choice_index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob | None]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    logits: tuple[int, torch.Tensor] | None = None  # keep_logits: (first position, fp32 [rows, vocab] on CPU)
    error: str | None = None  # finish_reason ERROR: what failed (for the log and the client's error body)


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0
    num_sampled_tokens: int = 0
    num_preemptions: int = 0
    num_imported_tokens: int = 0  # positions whose global KV a pull or import_prefix published (others' blocks)
    busy_time: float = 0.0  # seconds inside executor.execute
    num_failed_steps: int = 0  # steps whose execute raised (their requests ended with ERROR)
    num_wasted_positions: int = 0  # positions a launched step computed past its request's end (rolled back)
    num_late_mask_steps: int = 0  # decode steps launched before their grammar masks (drawn after the step before)
    num_verify_steps: int = 0  # verify chunks run (speculative decoding), all requests together
    num_draft_tokens: int = 0  # drafts they verified
    num_accepted_tokens: int = 0  # drafts accepted

    @property
    def accept_length(self) -> float:
        """Tokens per verify chunk: accepted drafts plus the target's token (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 1.0


class Executor(Protocol):
    """Runs one step's plan on the model and returns its tokens (in-process, or a Ray shard actor). An executor
    may also `launch(plan)`: start a decode step and return a PendingStep (engine/core/overlap.py) without
    waiting, or None where it cannot; the engine then overlaps its own work with the device's. One that can also
    `launch_forward(plan)` (the step's forward now, its draw by PendingForward.draw(masks) later) lets steps with
    grammar-constrained requests overlap too: the plan's masks are not read, the draw's are. An executor that
    holds processes (engine/core/shard_group.py) also has `close()`, which LLMEngine.close calls."""

    def execute(self, plan: StepPlan) -> StepOutput: ...

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Global blocks' flat records, uint8 [n, block_bytes] (engine/core/kv_blocks.py)."""
        ...

    def read_blocks_checked(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """read_blocks and the records' checksums, int64 [n] (kv_blocks.read_blocks_checked: summed on the device)."""
        ...

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None: ...

    def import_blocks(self, block_ids: list[int], reader: BlockReader) -> None:
        """Reads reader's blocks into those global blocks through the pools' owner's staging buffer, in
        overlapped chunks (engine/core/kv_import.py); returns once the pools hold them (on CUDA: the copies
        have ended); raises what the reader raised. May be called from another thread than steps, while they
        run: the blocks are held for the pull and unpublished (LLMEngine.begin_import), so no step reads or
        writes them, and a step sent before the call must not write them after it (a launched step of a request
        aborted since). Executors that serve KV sharing have it (in-process, a shard actor); the others need
        not."""
        ...

    def prepare_pulls(self) -> None:
        """Allocates what import_blocks uses (the staging buffer; a shard actor's transfer agent) ahead of the
        first pull, whose time would otherwise include it."""
        ...


class LocalExecutor:
    """The model and its paged pools in this process. With decode options on the kernel path, decode steps
    run on device buffers, and on CUDA their graphs are captured here (progress: a bar and a summary line)."""

    def __init__(self, model: Transformer, layout: CacheLayout, kernels: bool | None = None,
                 decode: DecodeOptions | None = None, progress: bool = False, drafter: Drafter | None = None):
        self.kv = PagedKVCache(model.cfg, layout, model.embed.weight.device)
        self.runner = ModelRunner(model, self.kv, kernels, decode, drafter)
        self.capture = capture_decode_graphs(self.runner, progress)
        self.importer: BlockImporter | None = None  # made at the first pull

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.runner.execute(plan)

    def launch(self, plan: StepPlan):
        """The step launched without waiting for its tokens (a decode step), or None (then execute it)."""
        return self.runner.launch(plan)

    def launch_forward(self, plan: StepPlan):
        """The step's forward launched, its draw waiting for the grammar masks (PendingForward.draw), or None."""
        return self.runner.launch_forward(plan)

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        return kv_blocks.read_blocks(self.kv, block_ids)

    def read_blocks_checked(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return kv_blocks.read_blocks_checked(self.kv, block_ids)

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        kv_blocks.write_blocks(self.kv, block_ids, data)

    def import_blocks(self, block_ids: list[int], reader: BlockReader) -> None:
        self.prepare_pulls()
        self.importer.import_blocks(block_ids, reader)

    def prepare_pulls(self) -> None:
        if self.importer is None:
            self.importer = BlockImporter(self.kv)


def capture_decode_graphs(runner: ModelRunner, progress: bool = False) -> dict[str, float] | None:
    """Capture the runner's decode graphs (CUDA, graphs on); prints the capture's time and memory when progress.
    Returns capture_decode's summary, None when nothing was captured."""
    step = runner.decode or runner.verify  # speculating, the verify step (engine/core/verify_step.py)
    if step is None or step.device.type != "cuda" or not step.options.graphs:
        return None
    summary = step.capture(progress)
    if progress:
        print(f"captured {summary['graphs']:.0f} {'decode' if runner.decode else 'verify'} graphs in "
              f"{summary['seconds']:.1f} s, {summary['bytes'] / 2**20:.0f} MiB", flush=True)
    if runner.decode is None and runner.draft_step is not None:  # speculating: the greedy drafts' graphs too
        drafts = runner.draft_step.capture(progress)
        if progress:
            print(f"captured {drafts['graphs']:.0f} draft graphs in {drafts['seconds']:.1f} s, "
                  f"{drafts['bytes'] / 2**20:.0f} MiB", flush=True)
        summary = {key: summary[key] + drafts[key] for key in summary}
    return summary


def prefix_salt(cfg: ModelConfig, weights_identity: str, global_block_size: int) -> bytes:
    """The prefix-cache salt, i.e. the replica fingerprint: the model config, the weights' identity and
    the global block's byte format (kv_blocks.layout_fingerprint). Pool sizes, SWA blocks and snapshots
    are left out: replicas that differ only in those hold the same global KV for a prefix, so they share."""
    layout = {"global_block_size": global_block_size,
              "records": kv_blocks.layout_fingerprint(cfg, global_block_size).hex()}
    return fingerprint(cfg.to_hf_dict(), weights_identity, layout)


def cache_layout(cfg: ModelConfig, config: EngineConfig) -> CacheLayout:
    return size_layout(cfg, config.cache_memory_bytes, max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens, max_snapshots=config.max_snapshots,
                       global_block_size=config.global_block_size, swa_block_size=config.swa_block_size,
                       speculative=config.is_speculative)


class LLMEngine:
    def __init__(self, cfg: ModelConfig, config: EngineConfig, make_executor: Callable[[CacheLayout], Executor], *,
                 eos_token_id: int | None = None, weights_identity: str = "unnamed",
                 grammars: GrammarCompiler | None = None):
        """grammars: compiles the requests' GrammarSpecs (None: a request with one is refused). Raises
        EngineConfigError for speculative settings the checkpoint cannot run."""
        check_speculative(config, cfg)
        self.cfg, self.config = cfg, config
        self.grammars = grammars
        self.eos_token_id = eos_token_id if eos_token_id is not None else cfg.eos_token_id
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        layout = cache_layout(cfg, config)
        salt = prefix_salt(cfg, weights_identity, layout.global_block_size)
        # bounded replay off is the reference-exact mode: prefix hits then rebuild window KV exactly too
        self.cache = KVCacheManager(layout, salt, config.enable_prefix_caching, exact_hits=not config.bounded_replay)
        self.scheduler = Scheduler(SchedulerConfig(cfg.window_size, config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.max_chunk_tokens, config.bounded_replay,
                                                   config.speculative_tokens, config.max_prefill_beside_decode),
                                   self.cache)
        self.draft_policy = DraftPolicy(config.speculative_min_survival, config.max_draft_tokens)
        self.executor = make_executor(layout)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._rng = random.Random()
        self._inflight: InFlight | None = None  # a launched decode step whose tokens are not read yet

    @classmethod
    def local(cls, model: Transformer, config: EngineConfig = EngineConfig(), progress: bool = False,
              drafter: Drafter | None = None, **kw) -> "LLMEngine":
        """The engine and the model in this process; drafter: what drafts with speculative decoding on (default:
        the model's DSpark stages, which it must have been loaded with)."""
        kernels = kernels_for(config.runner)
        decode = decode_options(config, model.cfg)
        return cls(model.cfg, config, lambda layout: LocalExecutor(model, layout, kernels, decode, progress, drafter),
                   **kw)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, config: EngineConfig = EngineConfig(), device: str = "cpu",
                        progress: bool = False, num_shards: int = 1) -> "LLMEngine":
        """The engine over a checkpoint: in this process, or split over num_shards local processes
        (engine/core/shard_group.py; this process is rank 0). Close it when done (`close`)."""
        if num_shards > 1:
            return cls.sharded(ckpt_dir, config, device, num_shards)
        from engine.config import load_config
        from engine.load import load_model

        check_speculative(config, load_config(ckpt_dir))  # before the weights load

        loaded = load_model(ckpt_dir, device, with_mtp=config.is_speculative, progress=progress)
        grammars = GrammarCompiler(loaded.tokenizer.path.read_text(encoding="utf-8"), loaded.tokenizer.eos_id)
        engine = cls.local(loaded.model, config, eos_token_id=loaded.tokenizer.eos_id,
                           weights_identity=str(Path(ckpt_dir).resolve()), grammars=grammars)
        engine.tokenizer = loaded.tokenizer
        return engine

    @classmethod
    def sharded(cls, ckpt_dir: str | Path, config: EngineConfig, device: str, num_shards: int,
                step_timeout: timedelta | None = None, drafter: Drafter | None = None) -> "LLMEngine":
        """The model split over num_shards local processes, each running the golden modules or the kernel path
        (config.runner; auto: the kernels on CUDA) with its decode step; step_timeout bounds a collective's wait
        for the other ranks (None: shard_group.STEP_TIMEOUT). Speculative decoding: every rank loads its slices of
        the DSpark stages and drafts over its own pools (drafter: another Drafter instead, pickled to every rank). A
        config the shards cannot split (the DSpark experts too when speculating) raises ShardingError, and
        speculative settings the checkpoint cannot run EngineConfigError, before any process starts."""
        from engine.checkpoint.sharding import check_shardable
        from engine.config import load_config
        from engine.core.shard_group import STEP_TIMEOUT, ShardGroupExecutor, default_threads
        from engine.tokenizer import load_tokenizer

        kernels = kernels_for(config.runner)
        kernels = device == "cuda" if kernels is None else kernels
        cfg = load_config(ckpt_dir)
        check_speculative(config, cfg)
        check_shardable(cfg, num_shards, include_mtp=config.is_speculative)
        tokenizer = load_tokenizer(ckpt_dir)
        path = str(Path(ckpt_dir).resolve())
        decode = decode_options(config, cfg)
        engine = cls(cfg, config,
                     lambda layout: ShardGroupExecutor.start(path, device, layout, num_shards,
                                                             step_timeout=step_timeout or STEP_TIMEOUT,
                                                             num_threads=default_threads(num_shards),
                                                             kernels=kernels, decode=decode, drafter=drafter),
                     eos_token_id=tokenizer.eos_id, weights_identity=path)
        engine.tokenizer = tokenizer
        return engine

    def close(self) -> None:
        """Release the executor's processes, if it has any (a shard group); the engine takes no more steps."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    # ---- API ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    force_ids: list[int] | None = None, keep_logits: bool = False,
                    images: Sequence[ImageInput] = ()) -> None:
        """Queue a request (and its n-1 siblings, ids request_id/1 ..). Raises RequestError.
        keep_logits: outputs carry the logits of every position the decoder computed (prompt rows too).
        images: the prompt's image spans, its ids already expanded (engine/vision/image_processing.py:
        prepare_image_prompt)."""
        try:
            params.validate()
        except SamplingError as e:
            raise RequestError(str(e)) from None
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if "/" in request_id:
            raise RequestError(f"request id {request_id!r} contains '/', which names the n > 1 choices")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids + list(force_ids or []) if not (isinstance(t, int) and 0 <= t < self.cfg.vocab_size)]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the context window is {self.max_model_len} "
                               "and at least one token must be generated")
        capacity = self.cache.layout.num_global_blocks * self.cache.layout.global_block_size
        if len(prompt_ids) + 1 > capacity:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this replica's KV cache holds {capacity}")
        if params.grammar is not None:
            if self.grammars is None:
                raise RequestError("this engine has no grammar compiler: constrained decoding is not available")
            try:
                self.grammars.matcher(params.grammar)  # compiled (and cached) now, so a bad grammar queues nothing
            except GrammarError as e:
                raise RequestError(f"the grammar does not compile: {e}") from None
        self._check_images(prompt_ids, images)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        req = self._new_request(request_id, request_id, 0, list(prompt_ids), params, seed, force_ids, tuple(images))
        req.keep_logits = keep_logits
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Abort a request group (every choice); frees its cache. False if unknown or already finished."""
        found = False
        for req in [r for r in self.requests.values() if r.request_id == request_id or r.fork_of == request_id]:
            found |= self.scheduler.abort(req.request_id) is not None
            self.requests.pop(req.request_id, None)
        return found

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """Schedule, run and draw one step; returns what every request got. With async scheduling on and a
        decode step in flight (engine/core/overlap.py), this step is launched behind it and the outputs are
        the one in flight's: the same tokens, one step later."""
        outputs: list[RequestOutput] = []
        if self._inflight is not None and not can_overlap(self.scheduler, hasattr(self.executor, "launch_forward")):
            outputs += self._collect(self._inflight)
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        outputs += [self._output(r, [], [], FinishReason.LENGTH) for r in out.cannot_grow]
        if self._inflight is not None:
            prev = self._inflight
            launched = bool(out.chunks) and self._launch(out, prev)
            outputs += self._collect(prev)
            if launched:
                self._may_launch_draw()
                return outputs
            out.chunks = [c for c in out.chunks if not c.request.is_finished]  # ended by prev's tokens
        if not out.chunks:
            return outputs
        if self.config.async_scheduling and not self.config.is_speculative and self._launch(out, None):
            return outputs  # speculating, each step's accepted tokens decide the next step's chunks: no overlap
        return outputs + self._run(out)

    def _run(self, out) -> list[RequestOutput]:
        """The synchronous step: execute, advance, draw (a verify chunk: take every token it accepted)."""
        samples, verifies = self._sample_specs(out), self._verify_specs(out)
        t0 = time.monotonic()
        try:
            result = self.executor.execute(plan_step(out, samples, verifies=verifies, draft_policy=self.draft_policy))
        except Exception as e:  # noqa: BLE001 -- ends this step's requests, never the engine
            return self._fail_step(out, e)
        elapsed = time.monotonic() - t0
        computed = {v.chunk: out.chunks[v.chunk].start + len(r.token_ids) for v, r in zip(verifies, result.verified)}
        self.scheduler.advance(out, computed=computed)
        self._count_step(out, elapsed)
        reqs, picks, j = [], [], 0  # the requests that take a drawn token, and the index of their spec
        for c in (c for c in out.chunks if c.sample and not c.num_draft):
            siblings = {child.choice_index: child for child in self._fork_siblings(c.request)}
            for choice in range(self._num_draws(c.request)):
                req = c.request if choice == 0 else siblings.get(choice)  # None: not forked, computes its own
                if req is not None:
                    reqs.append(req)
                    picks.append(j)
                j += 1
        sampled = result.sample
        outputs = [self._take(req, sampled.token_ids[j], sampled.logprobs[j], sampled.errors[j])
                   for req, j in zip(reqs, picks)]
        self.stats.num_sampled_tokens += len(reqs)
        outputs += [self._take_verified(out.chunks[v.chunk].request, r) for v, r in zip(verifies, result.verified)]
        for index, (first_pos, kept) in result.rows.items():
            self._keep_logits(out.chunks[index].request, first_pos, kept, outputs)
        return outputs

    def _take_verified(self, req: Request, verified) -> RequestOutput:
        """A verify chunk's tokens, in order (the runner cut them after a stop id, so only the last may end req)."""
        self.stats.num_verify_steps += 1
        self.stats.num_draft_tokens += verified.num_drafted
        self.stats.num_accepted_tokens += verified.num_accepted
        req.stats.num_verify_steps += 1
        req.stats.num_draft_tokens += verified.num_drafted
        req.stats.num_accepted_tokens += verified.num_accepted
        if verified.error is not None:
            return self._take(req, -1, None, verified.error)
        tokens, logprobs = [], []
        for i, (token, lp) in enumerate(zip(verified.token_ids, verified.logprobs)):
            o = self._take(req, token, lp, None)
            tokens += o.new_token_ids
            logprobs += o.new_logprobs
            if o.finished:
                assert i == len(verified.token_ids) - 1, \
                    f"{req.request_id} ended ({o.finish_reason}) at token {i} of the {len(verified.token_ids)} accepted"
        self.stats.num_sampled_tokens += len(tokens)
        return replace(o, new_token_ids=tokens, new_logprobs=logprobs)

    def _launch(self, out, prev: InFlight | None) -> bool:
        """Launch `out` without waiting for its tokens (a decode step the executor can launch); each of its
        requests gets a PENDING_TOKEN. False, with nothing changed, where it cannot. Behind prev with a constrained
        request, only its forward is launched (its masks need prev's tokens): _may_launch_draw launches its draw."""
        masks_later = prev is not None and any(c.request.grammar is not None for c in out.chunks)
        launch = getattr(self.executor, "launch_forward" if masks_later else "launch", None)
        if launch is None or not all(c.sample for c in out.chunks):
            return False
        samples = self._sample_specs(out, with_masks=not masks_later)
        if len(samples) != len(out.chunks):
            return False
        plan = plan_step(out, samples, from_rows(prev, out) if prev is not None else None)
        t0 = time.monotonic()
        try:
            pending = launch(plan)
        except Exception:  # noqa: BLE001 -- the synchronous path runs it again and ends its requests
            return False
        if pending is None:
            return False
        self.scheduler.advance(out, register=False)  # blocks are published once their tokens are known
        reqs = [c.request for c in out.chunks]
        for r in reqs:
            r.output_ids.append(PENDING_TOKEN)
        self._inflight = InFlight(out, reqs, [len(r.output_ids) - 1 for r in reqs], pending, t0, masks_later)
        return True

    def _may_launch_draw(self) -> None:
        """The step in flight's draw, where only its forward was launched: the step before is read now, so each
        constrained request's grammar has taken its last token; one that ended there draws unmasked (its token is
        dropped, as every draw of a finished request)."""
        f = self._inflight
        if f is None or not f.awaits_masks:
            return
        f.awaits_masks = False
        self.stats.num_late_mask_steps += 1
        try:
            f.pending = f.pending.draw(self._masks(f.reqs))
        except Exception as e:  # noqa: BLE001 -- _collect ends the step's requests, never the engine
            f.pending = FailedLaunch(e)

    def _collect(self, inflight: InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and hand them to its requests (those still running)."""
        assert not inflight.awaits_masks, "a step's tokens read before its draw was launched"
        if self._inflight is inflight:
            self._inflight = None
        try:
            sampled = inflight.pending.result().sample
        except Exception as e:  # noqa: BLE001 -- ends the step's requests, never the engine
            self.stats.num_failed_steps += 1
            message = f"the model step failed: {type(e).__name__}: {e}"
            return [self._take(r, -1, None, message, slot) for r, slot in zip(inflight.reqs, inflight.slots)
                    if not r.is_finished]
        self._count_step(inflight.out, time.monotonic() - inflight.t0)
        outputs = []
        for j, (req, slot) in enumerate(zip(inflight.reqs, inflight.slots)):
            if not req.is_finished:  # aborted meanwhile, or ended by an earlier step's token
                outputs.append(self._take(req, sampled.token_ids[j], sampled.logprobs[j], sampled.errors[j], slot))
                self.stats.num_sampled_tokens += 1
        return outputs

    def _count_step(self, out, elapsed: float) -> None:
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += out.num_tokens
        self.stats.busy_time += elapsed
        for c in out.chunks:
            if c.start < c.request.num_prompt_at_admission:
                c.request.stats.prefill_time += elapsed
            else:
                c.request.stats.decode_time += elapsed

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Offline convenience: run the prompts to completion, return each one's output ids."""
        ids = [f"gen-{self.stats.num_steps}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.add_request(rid, p, params)
        done: dict[str, list[int]] = {r: [] for r in ids}
        while self.has_unfinished:
            for o in self.step():
                done[o.request_id] += o.new_token_ids
        return [done[r] for r in ids]

    # ---- cross-replica KV sharing (call between steps, on the thread that steps) ---------------------
    def export_prefix(self, token_ids: list[int]) -> ExportedPrefix:
        """The full global blocks of token_ids' longest locally held prefix, as flat records."""
        _, block_ids, hashes = self.cache.cached_prefix(token_ids)
        return ExportedPrefix(self.cache.salt, hashes, self.executor.read_blocks(block_ids))

    def import_prefix(self, prefix: ExportedPrefix) -> int:
        """Writes another replica's exported blocks into free global blocks and publishes them, so the next
        request with that prefix takes them as a prefix-cache hit (then encoder replay of the last window).
        Returns how many of the prefix's tokens are held here now (the leading blocks it covers; fewer when the
        pool is short). A write that raises publishes nothing and raises. PrefixImportError for another
        fingerprint or block size. Runs the write where steps run (offline use; serving pulls through
        AsyncEngine.import_blocks)."""
        self._check_fingerprint(prefix.fingerprint)
        expected = kv_blocks.block_bytes(self.cfg, self.cache.layout.global_block_size)
        if prefix.data.shape[1] != expected:
            raise PrefixImportError(f"prefix blocks have {prefix.data.shape[1]} bytes, this replica's {expected}")
        pending = self.begin_import(prefix.fingerprint, prefix.hashes)
        return self._end_import_after(pending, lambda: self.executor.write_blocks(pending.fresh_blocks,
                                                                                prefix.data[pending.fresh]))

    def import_blocks(self, fingerprint: bytes, hashes: list[bytes], reader: BlockReader) -> int:
        """import_prefix for blocks another replica holds: hashes[i] names the reader's block i (under the
        owner's fingerprint); the executor reads only the ones missing here, straight into its staging buffer
        and pools (engine/core/kv_import.py). All three phases on this thread, steps waiting (offline use and
        tests; AsyncEngine.import_blocks runs the read beside the steps). A read that fails publishes none of
        the blocks (they recompute) and raises."""
        assert reader.num_blocks == len(hashes), f"{reader.num_blocks} blocks for {len(hashes)} hashes"
        pending = self.begin_import(fingerprint, hashes)
        return self._end_import_after(pending, lambda: self.executor.import_blocks(pending.fresh_blocks,
                                                                                 reader.select(pending.fresh)))

    def begin_import(self, fingerprint: bytes, hashes: list[bytes]) -> PendingImport:
        """A pull's first phase, between steps: holds a block for each leading hash (KVCacheManager.begin_import:
        the missing ones fresh, unpublished). The caller then has the executor write `pending.fresh_blocks` from
        its rows `pending.fresh` (that may run beside steps: no step reads or reuses those blocks), then calls
        end_import. PrefixImportError for another fingerprint (nothing held)."""
        self._check_fingerprint(fingerprint)
        return self.cache.begin_import(hashes)

    def end_import(self, pending: PendingImport, is_written: bool) -> int:
        """A pull's last phase, between steps: publishes its fresh blocks when is_written (the write has ended,
        on the device too), else frees them; releases the rest. Returns the tokens of the pull's leading run held
        here now (a block another pull in flight brings ends the run until that one publishes)."""
        num_published = self.cache.end_import(pending, is_written)
        self.stats.num_imported_tokens += num_published * self.cache.layout.global_block_size
        return self.cache.num_leading_held(pending.hashes) * self.cache.layout.global_block_size

    # ---- internals ----------------------------------------------------------------------------------
    def _check_fingerprint(self, fingerprint: bytes) -> None:
        if fingerprint != self.cache.salt:
            raise PrefixImportError(f"prefix fingerprint {fingerprint.hex()[:16]} is not this replica's "
                                    f"{self.cache.salt.hex()[:16]} (model, weights or block format differ)")

    def _end_import_after(self, pending: PendingImport, write: Callable[[], None]) -> int:
        if pending.fresh:
            try:
                write()
            except BaseException:
                self.end_import(pending, is_written=False)
                raise
        return self.end_import(pending, is_written=True)

    def _fail_step(self, out, error: Exception) -> list[RequestOutput]:
        """A step that raised: every request it scheduled (and the n-1 siblings that wait on a first
        choice's first token) ends with ERROR and gives back its cache; the engine steps on. An executor
        that cannot recover (a dead shard) fails every later step the same way until the replica's health
        check replaces it."""
        self.stats.num_failed_steps += 1
        message = f"the model step failed: {type(error).__name__}: {error}"
        failed = []
        for c in out.chunks:
            req = c.request
            if req.is_finished:
                continue
            self.scheduler.finish(req, FinishReason.ERROR)
            failed.append(self._output(req, [], [], FinishReason.ERROR, message))
            for sibling in range(1, req.params.n if req.choice_index == 0 and not req.output_ids else 1):
                failed.append(RequestOutput(f"{req.request_id}/{sibling}", req.request_id, sibling, [], [],
                                            len(req.prompt_ids), 0, True, FinishReason.ERROR, req.stats.copy(),
                                            error=message))
        return failed

    def _check_images(self, prompt_ids: list[int], images: Sequence[ImageInput]) -> None:
        if not images:
            return
        if not self.cfg.has_vision:
            raise RequestError("this model has no vision tower: it takes text only, not images")
        end = 0
        for k, im in enumerate(images):
            if im.start < end or im.end > len(prompt_ids):
                raise RequestError(f"image {k}: its span {im.start}..{im.end - 1} overlaps another or leaves the prompt")
            if any(t != self.cfg.image_token_id for t in prompt_ids[im.start:im.end]):
                raise RequestError(f"image {k}: its span's ids are not all the image token {self.cfg.image_token_id}")
            if im.key >= 0:
                raise RequestError(f"image {k}: its prefix-cache key must be negative, got {im.key}")
            end = im.end

    def _new_request(self, rid: str, group: str, choice: int, prompt: list[int], params: SamplingParams, seed: int,
                     force_ids: list[int] | None, images: tuple[ImageInput, ...] = ()) -> Request:
        req = Request(rid, prompt, params, seed, self.eos_token_id, self.max_model_len,
                      list(force_ids) if force_ids else None, images=images)
        req.fork_of = None if choice == 0 else group
        req.choice_index = choice
        if params.grammar is not None:
            req.grammar = self.grammars.matcher(params.grammar)
        req.stats.arrival_time = time.monotonic()
        self.requests[rid] = req
        return req

    def _keep_logits(self, req: Request, first_pos: int, rows: torch.Tensor, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            if o.request_id == req.request_id:
                o.logits = (first_pos, rows.cpu())
                return
        outputs.append(RequestOutput(req.request_id, req.fork_of or req.request_id, req.choice_index, [], [],
                                     len(req.prompt_ids), len(req.output_ids), logits=(first_pos, rows.cpu())))

    def _fork_siblings(self, parent: Request) -> list[Request]:
        """n > 1: when the first choice samples its first token, the others start from its prompt state."""
        forked = []
        for i in range(1, self._num_draws(parent)):
            seed = _sibling_seed(parent.seed, i)
            child = self._new_request(f"{parent.request_id}/{i}", parent.request_id, i, parent.prompt_ids,
                                      parent.params, seed, parent.force_ids, parent.images)
            child.stats = replace(parent.stats, first_token_time=None)  # it shares the prompt's history
            if self.scheduler.fork(parent, child):
                forked.append(child)
            else:  # no room to copy: it computes its own prompt later
                child.stats = RequestStats(arrival_time=parent.stats.arrival_time)
                self.scheduler.add(child)
        return forked

    @staticmethod
    def _num_draws(req: Request) -> int:
        """Tokens drawn from a sampled chunk's logits: n when the first choice of an n > 1 request draws its
        first token (the other choices fork from its prompt state then), else 1."""
        return req.params.n if req.choice_index == 0 and not req.output_ids else 1

    def _sample_specs(self, out, with_masks: bool = True) -> list[SampleSpec]:
        """What the step draws, in the order step() hands the tokens out: per sampled chunk (not a verify chunk)
        its request, then the n-1 choices forked from it (their seeds as _fork_siblings gives them). with_masks
        False: no grammar masks (they are drawn with later, _may_launch_draw)."""
        specs = []
        chunks = [c for c in out.chunks if c.sample and not c.num_draft]
        masks = self._masks([c.request for c in chunks]) if with_masks else [None] * len(chunks)
        for row, (c, allowed) in enumerate(zip(chunks, masks)):  # the siblings' grammars start as their first's
            req = c.request
            n_out = len(req.output_ids)
            force = req.force_ids[n_out] if req.force_ids is not None and n_out < len(req.force_ids) else None
            specs.append(SampleSpec(row, req.params, req.seed, n_out, force, allowed))
            specs += [SampleSpec(row, req.params, _sibling_seed(req.seed, i), 0, force, allowed)
                      for i in range(1, self._num_draws(req))]
        return specs

    def _masks(self, reqs: list[Request]) -> list[bytes | None]:
        """Each request's grammar mask for its next draw (None: no grammar, or finished), computed together."""
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.is_finished]
        masks: list[bytes | None] = [None] * len(reqs)
        if constrained:
            for i, mask in zip(constrained, self.grammars.masks([reqs[i].grammar for i in constrained])):
                masks[i] = mask
        return masks

    def _verify_specs(self, out) -> list[VerifySpec]:
        """Per verify chunk (in chunk order): what its rows draw, its teacher-forced ids and its stop ids."""
        specs = []
        for i, c in enumerate(out.chunks):
            if not c.num_draft:
                continue
            req = c.request
            n_out = len(req.output_ids)
            force = tuple(req.force_ids[n_out:n_out + c.num_draft + 1]) if req.force_ids is not None else ()
            stops = req.params.stop_token_ids + (() if req.params.ignore_eos or req.eos_token_id is None
                                                 else (req.eos_token_id,))
            specs.append(VerifySpec(i, req.params, req.seed, n_out, force, stops))
        return specs

    def _take(self, req: Request, token: int, lp, error: str | None, slot: int | None = None) -> RequestOutput:
        """A drawn token: appended (slot None) or in place of the request's PENDING_TOKEN at `slot`; ends the
        request on a stop, its length or an error (a later step's pending position rolled back first)."""
        if error is None and req.grammar is not None and not req.grammar.accept(token):
            error = f"the grammar does not allow the drawn token {token} ({req.grammar.error})"
        if error is not None:
            self._end(req, FinishReason.ERROR, len(req.output_ids) if slot is None else slot)
            return self._output(req, [], [], FinishReason.ERROR, error)
        if slot is None:
            req.output_ids.append(token)
        else:
            req.output_ids[slot] = token
        num_outputs = len(req.output_ids) if slot is None else slot + 1
        new_lp = None if lp is None else TokenLogprob(token, lp.logprob, lp.top)
        req.logprobs.append(new_lp)
        if req.stats.first_token_time is None:
            req.stats.first_token_time = time.monotonic()
        reason = req.check_stop(num_outputs)
        if reason is None and req.grammar is not None and req.grammar.is_done:
            reason = FinishReason.STOP  # the grammar is complete: only the end-of-sentence token could follow
        if reason is not None:
            self._end(req, reason, num_outputs)
        elif slot is not None:
            self.cache.register_full_blocks(req)  # its blocks' tokens are all known now
        return self._output(req, [token], [new_lp], reason)

    def _end(self, req: Request, reason: FinishReason, num_outputs: int) -> None:
        """Finish req with its first num_outputs outputs: a step launched after that token computed a position
        for nothing (its PENDING_TOKEN is dropped and the position rolled back)."""
        extra = len(req.output_ids) - num_outputs
        if extra > 0:
            del req.output_ids[num_outputs:]
            req.num_computed -= extra
            self.stats.num_wasted_positions += extra
        self.scheduler.finish(req, reason)

    def _output(self, req: Request, tokens: list[int], logprobs: list, reason: FinishReason | None,
                error: str | None = None) -> RequestOutput:
        if reason is not None:
            self.requests.pop(req.request_id, None)
        num_outputs = len(req.output_ids) - (bool(req.output_ids) and req.output_ids[-1] == PENDING_TOKEN)
        return RequestOutput(req.request_id, req.fork_of or req.request_id, req.choice_index, tokens, logprobs,
                             len(req.prompt_ids), num_outputs, reason is not None, reason, req.stats.copy(),
                             error=error)


def _sibling_seed(seed: int, choice: int) -> int:
    """Choice `choice` of an n > 1 request: its own seed, derived from the request's."""
    return (seed + choice * _SEED_STEP) % 2**63
