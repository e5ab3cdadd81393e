"""Load a DeepSeek-V4.1 safetensors checkpoint, validated tensor by tensor against `expected_tensors`.

Order of work: resolve the shard files (`model.safetensors.index.json` or one `model.safetensors`),
read and check every shard header ourselves (JSON, dtypes, byte ranges against the file size, so a
truncated file fails before any data is read), compare the whole inventory with the layout (missing,
unexpected, wrong shape, wrong dtype: all problems in one error, with a hint when a config value
explains them), then memory-map each shard once with `safetensors.safe_open` and read its tensors.
Every failure is a `CheckpointError` naming the tensor or file and what was expected (and the rank, when
the model is split over several).

A model-parallel rank validates the whole inventory the same way but reads only its part of each tensor
(`safe_open(...).get_slice`, engine/checkpoint/sharding.py's layout) and none of the other ranks' experts.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.checkpoint.layout import E8M0, FP4_PACKED, TensorSpec, expected_tensors, is_text_only_skippable, layer_of
from engine.checkpoint.sharding import TensorSlice, part_bytes, tensor_slice
from engine.config import ModelConfig
from engine.parallel import SINGLE, ShardSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_LISTED_PROBLEMS = 20
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

# bytes per element of each safetensors dtype label (F4: two per byte)
_LABEL_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
    "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1, "F4": 0.5, "C64": 8,
}
# Labels a reader may find for one of our TensorSpec dtypes (spec 6: FP4 experts read as I8, U8 or F4;
# spec 12: the fixtures disagree whether Engram's q/k weights are BF16 or F32).
_PACKED_FP4_LABELS = (FP4_PACKED, "U8", "F4")
_ALSO_ACCEPTED_SUFFIX = {".engram.q_weight": ("F32",), ".engram.k_weight": ("F32",)}

# Tensors whose shapes pin config fields, one field name per axis; used to explain shape errors.
_SHAPE_ANCHORS: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("embed.weight", ("vocab_size", "dim")),
    ("layers.0.attn.wq_a.weight", ("q_lora_rank", "dim")),
    ("layers.0.attn.wkv.weight", ("head_dim", "dim")),
    ("layers.0.attn.attn_sink", ("n_heads",)),
    ("layers.0.attn.wo_b.weight", ("dim", None)),
    ("layers.0.ffn.gate.weight", ("n_routed_experts", "dim")),
    ("layers.0.ffn.shared_experts.w1.weight", ("moe_inter_dim", "dim")),
)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or is damaged; the message names the tensor or file."""


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """Where a stored tensor's bytes are: `nbytes` bytes from byte `offset` of the file at `path`."""

    path: Path
    offset: int
    nbytes: int


class _Shard:
    """One safetensors file's header, checked against the file's size."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, dict] = {}
        self.data_start = 0  # the data section's first byte in the file
        self._read()

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"shard {self.path.name} is truncated or corrupt: {what}")

    def _read(self) -> None:
        size = self.path.stat().st_size
        if size < 8:
            raise self._fail(f"{size} bytes, less than the 8-byte header length")
        with open(self.path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise self._fail(f"header length {header_len} does not fit in a file of {size} bytes")
            raw = f.read(header_len)
        self.data_start = 8 + header_len
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        data_len = size - 8 - header_len
        data_end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                label, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            except (TypeError, KeyError, ValueError):
                raise self._fail(f"tensor {name}: malformed header entry {info!r}") from None
            if label not in _LABEL_BYTES:
                raise self._fail(f"tensor {name}: unknown dtype {label!r}")
            want = math.ceil(math.prod(shape) * _LABEL_BYTES[label])
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end) or end - begin != want:
                raise self._fail(f"tensor {name}: data_offsets [{begin}, {end}] do not hold {label} {shape} "
                                 f"({want} bytes)")
            if end > data_len:
                raise self._fail(f"tensor {name} ends at byte {end} of the data section, but the file has only "
                                 f"{data_len} data bytes ({size} bytes in all)")
            data_end = max(data_end, end)
            self.tensors[name] = {"dtype": label, "shape": shape, "begin": begin, "end": end}
        if data_end != data_len:
            raise self._fail(f"the header's tensors end at data byte {data_end} but the file has {data_len} "
                             "data bytes")


def _shard_paths(ckpt_dir: Path) -> tuple[dict[str, str] | None, list[Path]]:
    """(index weight_map or None, shard paths in order)."""
    index_path = ckpt_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{INDEX_FILE}: not valid JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{INDEX_FILE}: needs a \"weight_map\" object of tensor name -> shard file")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            if not (ckpt_dir / shard).is_file():
                raise CheckpointError(
                    f"{INDEX_FILE} maps {len(names)} tensors (e.g. {names[0]}) to shard {shard}, "
                    f"which does not exist in {ckpt_dir}")
        return weight_map, [ckpt_dir / s for s in sorted(by_shard)]
    if (ckpt_dir / SINGLE_FILE).is_file():
        return None, [ckpt_dir / SINGLE_FILE]
    raise CheckpointError(f"{ckpt_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _accepts(spec: TensorSpec, label: str, shape: list[int]) -> tuple[bool, bool]:
    """(dtype ok, shape ok) of a stored (label, shape) for `spec`."""
    if spec.is_packed_fp4:
        if label not in _PACKED_FP4_LABELS:
            return False, True
        # safetensors' F4 counts 4-bit elements: the header says [out, in], the bytes are [out, in/2]
        want = (spec.shape[0], 2 * spec.shape[1]) if label == "F4" else spec.shape
        return True, tuple(shape) == want
    extra = next((v for k, v in _ALSO_ACCEPTED_SUFFIX.items() if spec.name.endswith(k)), ())
    return label == spec.dtype or label in extra, tuple(shape) == spec.shape


def _neighbour_shard(name: str, located: dict[str, str]) -> str | None:
    """The shard holding the tensors that share the longest dotted prefix with `name`."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut]) + "."
        shards = Counter(s for n, s in located.items() if n.startswith(prefix))
        if shards:
            return shards.most_common(1)[0][0]
    return None


def _config_hints(cfg: ModelConfig, located: dict[str, str], shards: dict[str, _Shard]) -> list[str]:
    """Config fields that disagree with the weights, read off a few anchor tensors' shapes."""
    hints, seen = [], set()
    for name, fields in _SHAPE_ANCHORS:
        if name not in located:
            continue
        got = shards[located[name]].tensors[name]["shape"]
        if len(got) != len(fields):
            continue
        for field, value in zip(fields, got):
            if field and field not in seen and getattr(cfg, field) != value:
                seen.add(field)
                hints.append(f"config.json says {field}={getattr(cfg, field)} but {name} is {got}")
    return hints


def _count_hints(cfg: ModelConfig, missing: Iterable[str], unexpected: Iterable[str]) -> list[str]:
    """Missing/unexpected whole layers explained by n_layers / n_mtp_layers."""
    hints = []
    for kind, field in (("layers", "n_layers"), ("mtp", "n_mtp_layers")):
        extra = sorted({lay[1] for n in unexpected if (lay := layer_of(n)) and lay[0] == kind})
        absent = sorted({lay[1] for n in missing if (lay := layer_of(n)) and lay[0] == kind})
        if extra and extra[0] >= getattr(cfg, field):
            hints.append(f"config.json says {field}={getattr(cfg, field)} but the checkpoint has {kind}.{extra[-1]}")
        elif absent and len(absent) > 1 and absent[-1] == getattr(cfg, field) - 1:
            hints.append(f"config.json says {field}={getattr(cfg, field)} but the checkpoint has no "
                         f"{kind}.{absent[0]}..{absent[-1]}")
    return hints


def rank_prefix(shard: ShardSpec) -> str:
    """"rank r of N: " in front of a message when the model is split, else nothing."""
    return "" if shard.is_single else f"rank {shard.rank} of {shard.world_size}: "


def _validate(cfg: ModelConfig, expected: dict[str, TensorSpec], weight_map: dict[str, str] | None,
              shards: dict[str, _Shard], skip, model_shard: ShardSpec) -> dict[str, str]:
    """Check the inventory; returns name -> shard file name of the tensors to load."""
    problems: list[str] = []
    located: dict[str, str] = {}
    for fname, shard in shards.items():
        for name in shard.tensors:
            if name in located:
                problems.append(f"tensor {name} is stored twice ({located[name]} and {fname})")
            elif weight_map is not None and weight_map.get(name) != fname:
                listed = weight_map.get(name)
                problems.append(f"tensor {name} is in shard {fname} but {INDEX_FILE} "
                                + (f"maps it to {listed}" if listed else "does not list it"))
            else:
                located[name] = fname
    if weight_map is not None:  # expected names are reported below as missing
        problems += [f"{INDEX_FILE} maps tensor {n} to {s}, which does not contain it"
                     for n, s in weight_map.items() if n not in located and n not in expected]
    missing = []
    for name, spec in expected.items():
        if skip(name):
            continue
        if name not in located:
            missing.append(name)
            if weight_map is not None and name in weight_map:
                where = f"{INDEX_FILE} maps it to {weight_map[name]}, which does not contain it"
            elif weight_map is not None:
                near = _neighbour_shard(name, located)
                where = f"not in {INDEX_FILE}" + (f"; expected in {near} with its neighbours" if near else "")
            else:
                where = f"{SINGLE_FILE} does not contain it"
            problems.append(f"missing tensor {name} ({spec.dtype} {list(spec.shape)}): {where}")
            continue
        info = shards[located[name]].tensors[name]
        dtype_ok, shape_ok = _accepts(spec, info["dtype"], info["shape"])
        if not shape_ok:
            problems.append(f"tensor {name} has shape {info['shape']}, expected {list(spec.shape)}")
        if not dtype_ok:
            want = " / ".join(_PACKED_FP4_LABELS) if spec.is_packed_fp4 else spec.dtype
            problems.append(f"tensor {name} has dtype {info['dtype']}, expected {want}")
    unexpected = [n for n in located if n not in expected and not skip(n)]
    problems += [f"unexpected tensor {n} ({located[n]}): not part of the V4.1 layout for this config"
                 for n in unexpected]
    if problems:
        hints = _config_hints(cfg, located, shards) + _count_hints(cfg, missing, unexpected)
        listed = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(listed)
        raise CheckpointError(
            f"{rank_prefix(model_shard)}checkpoint does not match the config ({len(problems)} problems):\n  "
            + "\n  ".join(hints + listed) + (f"\n  ... and {more} more" if more else ""))
    return {n: s for n, s in located.items() if n in expected and not skip(n)}


def load_checkpoint(ckpt_dir: str | Path, cfg: ModelConfig, *, device: str | torch.device = "cpu",
                    include_mtp: bool = True, progress: bool = True, shard: ShardSpec = SINGLE,
                    exclude: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Read and validate every tensor of a V4.1 checkpoint; returns name -> tensor as stored (for a rank
    of a split model: its part of each tensor, none of other ranks' experts; sharding.tensor_slice).
    Tensors named in `exclude` are validated but not read (the caller maps them: engine/shared_tables.py).

    FP8 weights are float8_e4m3fn, scales float8_e8m0fnu, packed FP4 experts uint8 [out, in/2],
    everything else in its checkpoint dtype (`attn.wo_a` stays FP8 + scale). With a vision tower in the config
    (`cfg.has_vision`) vision.*, aligner.*, image_* and `gate.bias_vl` are read and must all be there; a
    text-only config skips them wherever they are. `mtp.*` is skipped when include_mtp is False.
    Raises CheckpointError on any mismatch or damage, before reading tensor data.
    """
    ckpt_dir = Path(ckpt_dir)
    weight_map, paths = _shard_paths(ckpt_dir)
    shards = {p.name: _Shard(p) for p in paths}
    expected = expected_tensors(cfg, include_vision=cfg.has_vision, include_mtp=True)

    def skip(name: str) -> bool:
        return ((not cfg.has_vision and is_text_only_skippable(name))
                or (not include_mtp and name.startswith("mtp.")))

    located = _validate(cfg, expected, weight_map, shards, skip, shard)
    parts = {n: part for n in located
             if n not in exclude and (part := tensor_slice(expected[n], cfg, shard)) is not None}
    by_shard: dict[str, list[str]] = {}
    for name in parts:
        by_shard.setdefault(located[name], []).append(name)
    total = sum(part_bytes(expected[n], parts[n]) for n in parts)
    out: dict[str, torch.Tensor] = {}
    show = progress and sys.stderr.isatty()
    desc = "loading checkpoint" if shard.is_single else f"loading rank {shard.rank}/{shard.world_size}"
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=not show) as bar:
        for fname in sorted(by_shard):
            with safe_open(str(ckpt_dir / fname), framework="pt", device=str(device)) as f:
                for name in by_shard[fname]:
                    out[name] = _read_part(f, expected[name], parts[name])
                    bar.update(part_bytes(expected[name], parts[name]))
    return out


def locate_tensors(ckpt_dir: str | Path, names: Iterable[str]) -> dict[str, TensorBytes]:
    """Where each named tensor's stored bytes are (headers only; call after load_checkpoint has validated
    the checkpoint). Raises CheckpointError for a name no shard holds."""
    names, (_, paths) = list(names), _shard_paths(Path(ckpt_dir))
    found: dict[str, TensorBytes] = {}
    for path in paths:
        shard = _Shard(path)
        for name, info in shard.tensors.items():
            found[name] = TensorBytes(path, shard.data_start + info["begin"], info["end"] - info["begin"])
    missing = [n for n in names if n not in found]
    if missing:
        raise CheckpointError(f"tensor {missing[0]} is in no shard of {ckpt_dir}")
    return {n: found[n] for n in names}


def _read_part(f, spec: TensorSpec, part: TensorSlice) -> torch.Tensor:
    """The whole tensor, or its slice along part.dim (only what the slice covers is read from the file), compact:
    get_slice may return a view into more than the slice (a column slice: a strided view of whole rows), whose
    storage the rank would keep (the whole tensor's bytes) and which the kernels, needing contiguous weights,
    refuse; such a slice is copied into a tensor of its own."""
    if part.dim is None:
        return _as_storage_dtype(f.get_tensor(spec.name), spec)
    assert not spec.is_packed_fp4, f"{spec.name}: packed FP4 tensors (routed experts) are never sliced"
    index = tuple([slice(None)] * part.dim + [slice(part.start, part.stop)])
    t = f.get_slice(spec.name)[index]
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return _as_storage_dtype(t, spec)


def _as_storage_dtype(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    if spec.is_packed_fp4:
        return t.view(torch.uint8).reshape(spec.shape)
    if spec.dtype == E8M0 and t.dtype != torch.float8_e8m0fnu:
        return t.view(torch.float8_e8m0fnu)
    return t
