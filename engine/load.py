"""Build the golden model from a checkpoint folder: config, tokenizer, Engram tables, weights."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.checkpoint.layout import component_of
from engine.checkpoint.loader import CheckpointError, load_checkpoint, rank_prefix
from engine.checkpoint.sharding import check_shardable
from engine.config import ModelConfig, load_config
from engine.engram_tables import EngramTables, build_compressed_token_map
from engine.model.engram import EngramEmbedding
from engine.model.transformer import Transformer
from engine.parallel import SINGLE, ShardSpec
from engine.shared_tables import SharedTables, TableSpec
from engine.tokenizer import Tokenizer, load_tokenizer


@dataclass(slots=True)
class LoadedModel:
    cfg: ModelConfig
    tokenizer: Tokenizer
    model: Transformer
    engram_host: SharedTables | None = None  # the node's shared Engram tables when mapped (also model.engram_host)


def build_engram_tables(cfg: ModelConfig, tokenizer: Tokenizer) -> EngramTables | None:
    """Engram's static tables from the tokenizer; checked against the config's row counts."""
    if not cfg.engram_layer_ids:
        return None
    token_map, num_compressed = build_compressed_token_map(tokenizer)
    if num_compressed != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"tokenizer.json gives {num_compressed} compressed Engram ids but config.json says "
                              f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}")
    tables = EngramTables.build(torch.from_numpy(token_map), num_compressed, cfg.engram_layer_ids,
                                cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size, cfg.engram_pad_id)
    if tables.num_embeddings != cfg.engram_num_embeddings:
        raise CheckpointError(f"Engram primes give table rows {tables.num_embeddings} but config.json says "
                              f"engram_num_embeddings={list(cfg.engram_num_embeddings)}")
    return tables


def load_model(ckpt_dir: str | Path, device: str | torch.device = "cpu", *, with_mtp: bool = True,
               with_vision: bool = True, progress: bool = True, shard: ShardSpec = SINGLE,
               shared_engram: bool = False) -> LoadedModel:
    """Engram tables stay in host memory (the real ones are ~98 GB each); everything else goes to `device`.
    With a shard of a split model: that rank's part only (engine/checkpoint/sharding.py); a config the
    shards cannot split raises ShardingError naming the dimension, before anything is read.
    shared_engram: the Engram tables are mapped read-only from the node's one shared copy (engine/shared_tables.py,
    made by the first process that asks; page-locked when `device` is CUDA) instead of read into this process;
    the mapping is `model.engram_host` and lives as long as the model.
    with_vision: read the vision tower when the config has one (whole on every rank); False loads the model as
    text-only (the returned cfg then has no tower: vision_n_layers 0)."""
    ckpt_dir = Path(ckpt_dir)
    cfg = load_config(ckpt_dir)
    if not with_vision:
        cfg = replace(cfg, vision_n_layers=0)
    check_shardable(cfg, shard.world_size, include_mtp=with_mtp)
    tokenizer = load_tokenizer(ckpt_dir)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"tokenizer.json has {tokenizer.vocab_size} ids but config.json says vocab_size={cfg.vocab_size}")
    tables = build_engram_tables(cfg, tokenizer)
    with torch.device("meta"):
        model = Transformer(cfg, tables, with_mtp=with_mtp, shard=shard)
    shared = {n: TableSpec(t.dtype, tuple(t.shape)) for n, t in model.state_dict(keep_vars=True).items()
              if shared_engram and component_of(n) == "Engram tables"}
    weights = load_checkpoint(ckpt_dir, cfg, include_mtp=with_mtp, progress=progress, shard=shard, exclude=shared)
    device = torch.device(device)
    model.engram_host = SharedTables.open(ckpt_dir, shared) if shared else None
    if model.engram_host is not None:
        weights.update(model.engram_host.tensors)
        if device.type == "cuda":
            model.engram_host.pin()
    check_parts(model, weights, shard)
    model.load_state_dict(weights, strict=True, assign=True)
    for module in model.modules():
        if isinstance(module, EngramEmbedding):
            continue
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))
    if tables is not None:
        model.engram_tables = tables.to(device)
    return LoadedModel(cfg, tokenizer, model.eval(), model.engram_host)


def check_parts(model: Transformer, weights: dict[str, torch.Tensor], shard: ShardSpec) -> None:
    """The tensors read for this rank are exactly the model's buffers, shape for shape (the checkpoint
    layout's split and the model classes' split agree); else CheckpointError naming the tensor and rank."""
    wanted = dict(model.state_dict(keep_vars=True))
    problems = [f"tensor {n} is not read for this rank" for n in wanted if n not in weights]
    problems += [f"tensor {n} was read but the model has no such buffer" for n in weights if n not in wanted]
    problems += [f"tensor {n} has shape {list(t.shape)} for this rank, the model holds {list(wanted[n].shape)}"
                 for n, t in weights.items() if n in wanted and t.shape != wanted[n].shape]
    if problems:
        raise CheckpointError(f"{rank_prefix(shard)}" + "; ".join(problems[:5])
                              + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else ""))
