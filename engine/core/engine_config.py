"""The engine's configuration as plain data (no torch): built at the edge (CLI flags, the server's settings)
and passed down as values; the HTTP ingress imports it without the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.config import ModelConfig

class EngineConfigError(ValueError):
    """A configuration the engine cannot run (the message names the setting and why)."""


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
    max_prefill_beside_decode: int | None = None  # prefill positions a step with decodes may add (None: the budget)
    bounded_replay: bool = True
    enable_prefix_caching: bool = True
    cache_memory_bytes: int = 256 << 20
    max_snapshots: int = 8
    global_block_size: int = 64
    swa_block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    runner: RunnerKind = "auto"  # auto: the kernels on CUDA, the golden modules on CPU (engine/core/runner.py)
    decode_step: bool = True  # kernel path: decode steps on device buffers (engine/core/decode_step.py)
    cuda_graphs: bool = True  # ... replayed as CUDA graphs captured at start-up (CUDA only)
    async_scheduling: bool = True  # launch a decode step before reading the last one's tokens (engine/core/overlap.py)
    split_mixed_steps: bool = True  # a step's decodes through the decode step, its prefills eagerly (split_step.py)
    # speculative decoding (engine/core/speculative.py): drafts a decoding request verifies per step, at most the
    # checkpoint's DSpark block (0: off). Async scheduling is off while it is on (a step's tokens decide the next).
    speculative_tokens: int = 0
    speculative_min_survival: float = 0.0  # verify a draft when the drafter's survival estimate is at least this
    max_draft_tokens: int | None = None  # drafts verified per step, all requests together (None: no cap)

    @property
    def is_speculative(self) -> bool:
        return self.speculative_tokens > 0


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """What the kernel path's decode step (engine/core/decode_step.py) needs from the engine's configuration."""

    max_batch: int  # the engine's max_num_seqs
    max_model_len: int
    graphs: bool = True  # capture CUDA graphs (on CUDA); False runs the same step eagerly
    max_draft: int = 0  # speculative decoding: drafts a verify chunk may hold (engine/core/verify_step.py's K buckets)
    split_mixed: bool = True  # a mixed step's decode chunks run here too, its others eagerly (engine/core/split_step.py)


def decode_options(config: EngineConfig, cfg: ModelConfig) -> DecodeOptions | None:
    """What the runner's decode step needs from the engine's configuration (None: the step is off)."""
    if not config.decode_step:
        return None
    return DecodeOptions(config.max_num_seqs, config.max_model_len or cfg.max_position_embeddings, config.cuda_graphs,
                         config.speculative_tokens, config.split_mixed_steps)


def check_speculative(config: EngineConfig, cfg: ModelConfig) -> None:
    """Raises EngineConfigError for speculative settings this checkpoint cannot run (either runner, any number of
    shards: a shard count the DSpark stages cannot split is checkpoint.sharding.check_shardable's refusal)."""
    k = config.speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise EngineConfigError(f"--speculative-tokens must be an integer >= 0, got {k!r}")
    if k == 0:
        return
    if cfg.n_mtp_layers == 0:
        raise EngineConfigError(f"--speculative-tokens {k}: this checkpoint has no DSpark stages to draft with")
    if k > cfg.dspark_block_size:
        raise EngineConfigError(f"--speculative-tokens {k} is past the checkpoint's DSpark block of "
                                f"{cfg.dspark_block_size} tokens (dspark_block_size): use 1..{cfg.dspark_block_size}, "
                                "or 0 for off")
    if not 0.0 <= config.speculative_min_survival <= 1.0:
        raise EngineConfigError(f"speculative_min_survival must be in [0, 1], got {config.speculative_min_survival}")
    if config.max_draft_tokens is not None and config.max_draft_tokens < 0:
        raise EngineConfigError(f"max_draft_tokens must be >= 0 or None, got {config.max_draft_tokens}")
