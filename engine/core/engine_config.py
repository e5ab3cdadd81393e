"""The engine's configuration as plain data (no torch): built at the edge (CLI flags, the server's settings)
and passed down as values; the HTTP ingress imports it without the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.config import ModelConfig

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
    decode_step: bool = True  # kernel path: decode steps on device buffers (engine/core/decode_step.py)
    cuda_graphs: bool = True  # ... replayed as CUDA graphs captured at start-up (CUDA only)
    async_scheduling: bool = True  # launch a decode step before reading the last one's tokens (engine/core/overlap.py)


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """What the kernel path's decode step (engine/core/decode_step.py) needs from the engine's configuration."""

    max_batch: int  # the engine's max_num_seqs
    max_model_len: int
    graphs: bool = True  # capture CUDA graphs (on CUDA); False runs the same step eagerly


def decode_options(config: EngineConfig, cfg: ModelConfig) -> DecodeOptions | None:
    """What the runner's decode step needs from the engine's configuration (None: the step is off)."""
    if not config.decode_step:
        return None
    return DecodeOptions(config.max_num_seqs, config.max_model_len or cfg.max_position_embeddings, config.cuda_graphs)
