"""The engine loop: add_request / abort / step over the scheduler, the batched runner and the sampler.

A step is schedule -> execute -> advance -> sample: the scheduler plans which positions each request
computes, the runner computes them over the paged pools, and every request whose computed positions
reached its tokens gets its next token (teacher-forced ids win over sampled ones while they last).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from engine.config import ModelConfig
from engine.core import kv_blocks
from engine.core.cache_manager import CacheLayout, KVCacheManager
from engine.core.kv_blocks import ExportedPrefix, PrefixImportError
from engine.core.kv_cache import PagedKVCache, size_layout
from engine.core.plan import StepPlan, plan_step
from engine.core.prefix_hash import fingerprint
from engine.core.request import FinishReason, Request, RequestStats, TokenLogprob
from engine.core.runner import ModelRunner
from engine.core.step_rows import StepLogits
from engine.core.sampler import SampleRow, sample
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.model.transformer import Transformer

_SEED_STEP = 0x9E3779B97F4A7C15


class RequestError(ValueError):
    """A request the engine cannot take (the message names what is wrong); nothing was queued."""


RunnerKind = Literal["auto", "kernels", "golden"]
RUNNER_KINDS: tuple[str, ...] = ("auto", "kernels", "golden")


def kernels_for(runner: RunnerKind) -> bool | None:
    """EngineConfig.runner -> ModelRunner's `kernels` argument (None: chosen by the model's device)."""
    assert runner in RUNNER_KINDS, f"runner must be one of {RUNNER_KINDS}, got {runner!r}"
    return None if runner == "auto" else runner == "kernels"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_chunk_tokens: int | None = None
    bounded_replay: bool = True
    enable_prefix_caching: bool = True
    cache_memory_bytes: int = 256 << 20
    max_snapshots: int = 8
    global_block_size: int = 64
    swa_block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    runner: RunnerKind = "auto"  # auto: the kernels on CUDA, the golden modules on CPU (engine/core/runner.py)


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


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0
    num_sampled_tokens: int = 0
    num_preemptions: int = 0
    num_imported_tokens: int = 0  # positions whose global KV import_prefix wrote (another replica's blocks)
    busy_time: float = 0.0  # seconds inside executor.execute


class Executor(Protocol):
    """Runs one step's plan on the model and returns its logits (in-process, or a Ray shard actor)."""

    def execute(self, plan: StepPlan) -> StepLogits: ...

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Global blocks' flat records, uint8 [n, block_bytes] (engine/core/kv_blocks.py)."""
        ...

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None: ...


class LocalExecutor:
    """The model and its paged pools in this process."""

    def __init__(self, model: Transformer, layout: CacheLayout, kernels: bool | None = None):
        self.kv = PagedKVCache(model.cfg, layout, model.embed.weight.device)
        self.runner = ModelRunner(model, self.kv, kernels)

    def execute(self, plan: StepPlan) -> StepLogits:
        return self.runner.execute(plan)

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        return kv_blocks.read_blocks(self.kv, block_ids)

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        kv_blocks.write_blocks(self.kv, block_ids, data)


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
                       global_block_size=config.global_block_size, swa_block_size=config.swa_block_size)


class LLMEngine:
    def __init__(self, cfg: ModelConfig, config: EngineConfig, make_executor: Callable[[CacheLayout], Executor], *,
                 eos_token_id: int | None = None, weights_identity: str = "unnamed"):
        self.cfg, self.config = cfg, config
        self.eos_token_id = eos_token_id if eos_token_id is not None else cfg.eos_token_id
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        layout = cache_layout(cfg, config)
        salt = prefix_salt(cfg, weights_identity, layout.global_block_size)
        # bounded replay off is the reference-exact mode: prefix hits then rebuild window KV exactly too
        self.cache = KVCacheManager(layout, salt, config.enable_prefix_caching, exact_hits=not config.bounded_replay)
        self.scheduler = Scheduler(SchedulerConfig(cfg.window_size, config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.max_chunk_tokens, config.bounded_replay), self.cache)
        self.executor = make_executor(layout)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._rng = random.Random()

    @classmethod
    def local(cls, model: Transformer, config: EngineConfig = EngineConfig(), **kw) -> "LLMEngine":
        """The engine and the model in this process."""
        kernels = kernels_for(config.runner)
        return cls(model.cfg, config, lambda layout: LocalExecutor(model, layout, kernels), **kw)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, config: EngineConfig = EngineConfig(), device: str = "cpu",
                        progress: bool = False) -> "LLMEngine":
        from engine.load import load_model

        loaded = load_model(ckpt_dir, device, with_mtp=False, progress=progress)
        engine = cls.local(loaded.model, config, eos_token_id=loaded.tokenizer.eos_id,
                           weights_identity=str(Path(ckpt_dir).resolve()))
        engine.tokenizer = loaded.tokenizer
        return engine

    # ---- API ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    force_ids: list[int] | None = None, keep_logits: bool = False) -> None:
        """Queue a request (and its n-1 siblings, ids request_id/1 ..). Raises RequestError.
        keep_logits: outputs carry the logits of every position the decoder computed (prompt rows too)."""
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
        seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
        req = self._new_request(request_id, request_id, 0, list(prompt_ids), params, seed, force_ids)
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
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        ended = [self._output(r, [], [], FinishReason.LENGTH) for r in out.cannot_grow]
        if not out.chunks:
            return ended
        t0 = time.monotonic()
        step_logits = self.executor.execute(plan_step(out))
        logits = step_logits.sample
        elapsed = time.monotonic() - t0
        self.scheduler.advance(out)
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += out.num_tokens
        self.stats.busy_time += elapsed
        for c in out.chunks:
            if c.start < c.request.num_prompt_at_admission:
                c.request.stats.prefill_time += elapsed
            else:
                c.request.stats.decode_time += elapsed
        rows, row_logits = [], []
        for i, c in enumerate(c for c in out.chunks if c.sample):
            for req in [c.request, *self._fork_siblings(c.request)]:
                rows.append(req)
                row_logits.append(i)
        outputs = ended + self._append_tokens(rows, logits[row_logits] if rows else logits)
        self.stats.num_sampled_tokens += len(rows)
        for index, (first_pos, kept) in step_logits.rows.items():
            self._keep_logits(out.chunks[index].request, first_pos, kept, outputs)
        return outputs

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
        """Writes another replica's exported blocks into free global blocks and registers them, so the
        next request with that prefix takes them as a prefix-cache hit (then encoder replay of the last
        window). Returns how many of the prefix's tokens are held here now (the leading blocks it
        covers; fewer when the pool is short). Raises PrefixImportError for another fingerprint."""
        if prefix.fingerprint != self.cache.salt:
            raise PrefixImportError(f"prefix fingerprint {prefix.fingerprint.hex()[:16]} is not this replica's "
                                    f"{self.cache.salt.hex()[:16]} (model, weights or block format differ)")
        expected = kv_blocks.block_bytes(self.cfg, self.cache.layout.global_block_size)
        if prefix.data.shape[1] != expected:
            raise PrefixImportError(f"prefix blocks have {prefix.data.shape[1]} bytes, this replica's {expected}")
        targets = self.cache.import_prefix(prefix.hashes)
        fill = [i for i, b in enumerate(targets) if b is not None]
        if fill:
            self.executor.write_blocks([targets[i] for i in fill], prefix.data[fill])
            self.stats.num_imported_tokens += len(fill) * self.cache.layout.global_block_size
        return len(targets) * self.cache.layout.global_block_size

    # ---- internals ----------------------------------------------------------------------------------
    def _new_request(self, rid: str, group: str, choice: int, prompt: list[int], params: SamplingParams, seed: int,
                     force_ids: list[int] | None) -> Request:
        req = Request(rid, prompt, params, seed, self.eos_token_id, self.max_model_len,
                      list(force_ids) if force_ids else None)
        req.fork_of = None if choice == 0 else group
        req.choice_index = choice
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
        if parent.params.n == 1 or parent.choice_index != 0 or parent.output_ids:
            return []
        forked = []
        for i in range(1, parent.params.n):
            seed = (parent.seed + i * _SEED_STEP) % 2**63
            child = self._new_request(f"{parent.request_id}/{i}", parent.request_id, i, parent.prompt_ids,
                                      parent.params, seed, parent.force_ids)
            child.stats = replace(parent.stats, first_token_time=None)  # it shares the prompt's history
            if self.scheduler.fork(parent, child):
                forked.append(child)
            else:  # no room to copy: it computes its own prompt later
                child.stats = RequestStats(arrival_time=parent.stats.arrival_time)
                self.scheduler.add(child)
        return forked

    def _append_tokens(self, reqs: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        if not reqs:
            return []
        sampled = sample(logits, [SampleRow(r.params, r.seed, len(r.output_ids)) for r in reqs])
        outputs = []
        for row, (req, token, lp) in enumerate(zip(reqs, sampled.token_ids, sampled.logprobs)):
            n_out = len(req.output_ids)
            if req.force_ids is not None and n_out < len(req.force_ids):
                token = req.force_ids[n_out]
            req.output_ids.append(token)
            new_lp = None if lp is None else TokenLogprob(token, _logprob_of(lp, token, logits, row), lp.top)
            req.logprobs.append(new_lp)
            if req.stats.first_token_time is None:
                req.stats.first_token_time = time.monotonic()
            reason = req.check_stop()
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req, [token], [new_lp], reason))
        return outputs

    def _output(self, req: Request, tokens: list[int], logprobs: list, reason: FinishReason | None) -> RequestOutput:
        if reason is not None:
            self.requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.fork_of or req.request_id, req.choice_index, tokens, logprobs,
                             len(req.prompt_ids), len(req.output_ids), reason is not None, reason, replace(req.stats))


def _logprob_of(lp, token: int, logits: torch.Tensor, row: int) -> float:
    """The sampler's logprob is the sampled token's; a teacher-forced token needs its own."""
    if token == lp.token_id:
        return lp.logprob
    return float(torch.log_softmax(logits[row].double(), dim=-1)[token])
