"""The server's settings, built once at the edge from CLI flags and a few env vars (parsed strictly here).

Precedence: a CLI flag, else its env var (only those in `ENV_VARS`), else the default. A bad value fails
loudly with a `SettingsError` naming the flag or variable. Everything downstream gets the frozen
`ServeSettings` value (the replica receives it as its constructor argument).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from engine.config import ConfigError, load_config
from engine.core.engine_config import RUNNER_KINDS, EngineConfig, RunnerKind
from engine.shard_spec import check_shardable
from serve_app.image_parts import AllowedHost, ImagePolicy

DEFAULT_MODEL_NAME = "deepseek-v4.1-flash"
_DEFAULT_ENGINE = EngineConfig()
_DEFAULT_IMAGES = ImagePolicy()

# the env vars read at all: field -> variable (a CLI flag wins over its variable)
ENV_VARS: dict[str, str] = {
    "checkpoint": "DSV41_CHECKPOINT",
    "device": "DSV41_DEVICE",
    "cache_memory_bytes": "DSV41_CACHE_MEMORY",
    "port": "DSV41_PORT",
    "api_key": "DSV41_API_KEY",
    "redis_url": "DSV41_REDIS_URL",
    "image_url_hosts": "DSV41_IMAGE_URL_HOSTS",
}


class SettingsError(ValueError):
    """A setting with a bad value; the message names the flag or env var."""


Device = Literal["cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class ServeSettings:
    checkpoint: str  # folder with config.json, tokenizer files and safetensors shards, readable on every node
    model_name: str = DEFAULT_MODEL_NAME  # the served name (the API's "model")
    num_replicas: int = 1
    num_shards: int = 1  # model-parallel ranks per replica: a ShardWorker actor each
    device: Device = "cpu"
    # of one GPU per shard actor (cuda): 0.5 puts two replicas' shard actors on one GPU (each replica then sizes
    # its KV cache with cache_memory_bytes, so the two budgets plus two copies of the weights must fit the GPU)
    gpu_fraction: float = 1.0
    # engine (see EngineConfig)
    cache_memory_bytes: int = _DEFAULT_ENGINE.cache_memory_bytes
    max_num_seqs: int = _DEFAULT_ENGINE.max_num_seqs
    max_num_batched_tokens: int = _DEFAULT_ENGINE.max_num_batched_tokens
    max_chunk_tokens: int | None = _DEFAULT_ENGINE.max_chunk_tokens
    max_prefill_beside_decode: int | None = _DEFAULT_ENGINE.max_prefill_beside_decode
    max_model_len: int | None = _DEFAULT_ENGINE.max_model_len  # None: the model's context window
    bounded_replay: bool = _DEFAULT_ENGINE.bounded_replay
    enable_prefix_caching: bool = _DEFAULT_ENGINE.enable_prefix_caching
    runner: RunnerKind = _DEFAULT_ENGINE.runner  # auto: the kernels on CUDA, the golden modules on CPU
    speculative_tokens: int = _DEFAULT_ENGINE.speculative_tokens  # DSpark drafts verified per step (0: off)
    # API
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    max_n: int = 8  # most choices one request may ask for
    max_messages: int = 2048  # most messages in one chat request (OpenAI's limit)
    max_output_tokens: int | None = None  # most max_tokens one request may ask for; None: the context window
    max_body_bytes: int = 8 << 20
    # a prompt's characters (chat: the rendered text) above this are a 400 before tokenising, which costs
    # ~1 s of one core per 1.2 M characters; the default is about the 1M-token window at ~4 characters a token
    max_prompt_chars: int = 4_000_000
    # images (chat image_url parts; serve_app/image_parts.py): per request, and per image (encoded bytes; pixels
    # from the header, before decoding); a model without a vision tower refuses every image
    max_images: int = _DEFAULT_IMAGES.max_images
    max_image_bytes: int = _DEFAULT_IMAGES.max_image_bytes
    max_image_pixels: int = _DEFAULT_IMAGES.max_image_pixels
    max_request_image_bytes: int = _DEFAULT_IMAGES.max_request_image_bytes
    max_request_image_pixels: int = _DEFAULT_IMAGES.max_request_image_pixels
    # http(s) image URLs are fetched from these hosts only (AllowedHost: "host[:port]" https, "http://host[:port]"
    # plain http too); empty: none, every URL is a 400
    image_url_hosts: tuple[str, ...] = ()
    image_fetch_timeout_s: float = _DEFAULT_IMAGES.fetch_timeout_s
    host: str = "0.0.0.0"
    port: int = 8000
    # Serve
    max_ongoing_requests: int = 64  # per replica; above max_num_seqs they wait in the engine's queue
    replica_num_cpus: float = 1.0  # the replica process (scheduler, sampler); the device belongs to the shard
    health_check_period_s: float = 10.0
    graceful_shutdown_timeout_s: float = 30.0
    request_log_file: str | None = None  # also append the request_end JSON lines to this file
    # cross-replica KV sharing (serve_app/kv_sharing.py, serve_app/router.py)
    kv_sharing: bool = False  # replicas publish finished prefixes and pull the ones a peer owns
    redis_url: str | None = None  # the ownership index, e.g. redis://host:6379/0; required with kv_sharing
    host_kv_bytes: int = 1 << 30  # per replica: the host store peers read exported blocks from
    kv_same_node_reads: bool = True  # pull from an owner on this node through its shared memory, not NIXL
    region: str = "local"  # a pull prefers an owner in the same region

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SettingsError(f"{_flag(name)} must be {what}, got {getattr(self, name)!r}")

        need(bool(self.checkpoint), "checkpoint", f"a checkpoint folder (or set {ENV_VARS['checkpoint']})")
        need(bool(self.model_name), "model_name", "a non-empty name")
        for name in ("num_replicas", "num_shards", "max_num_seqs", "max_num_batched_tokens", "cache_memory_bytes",
                     "max_n", "max_messages", "max_body_bytes", "max_prompt_chars", "max_ongoing_requests",
                     "max_images", "max_image_bytes", "max_image_pixels", "max_request_image_bytes",
                     "max_request_image_pixels"):
            need(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an integer >= 1")
        need(self.device in ("cpu", "cuda"), "device", "'cpu' or 'cuda'")
        need(self.runner in RUNNER_KINDS, "runner", " or ".join(RUNNER_KINDS))
        need(_is_int(self.speculative_tokens) and self.speculative_tokens >= 0, "speculative_tokens",
             "an integer >= 0 (0 = off; at most the checkpoint's DSpark block, checked when it loads)")
        need(isinstance(self.gpu_fraction, (int, float)) and not isinstance(self.gpu_fraction, bool)
             and 0 < self.gpu_fraction <= 1, "gpu_fraction", "a number in (0, 1]")
        if self.gpu_fraction < 1 and self.device != "cuda":
            raise SettingsError(f"--gpu-fraction {self.gpu_fraction} with --device {self.device}: a fraction of a GPU "
                                "applies to --device cuda only")
        if self.gpu_fraction < 1 and _is_int(self.num_shards) and self.num_shards > 1:
            raise SettingsError(f"--gpu-fraction {self.gpu_fraction} with --num-shards {self.num_shards}: a sharded "
                                "replica takes whole GPUs (its ranks' collectives would share one); use one or the other")
        if self.num_shards > 1:
            self._check_shards()
        for name in ("bounded_replay", "enable_prefix_caching", "kv_sharing", "kv_same_node_reads"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        for name in ("max_chunk_tokens", "max_prefill_beside_decode"):
            value = getattr(self, name)
            need(value is None or (_is_int(value) and value >= 1), name, "an integer >= 1 or unset")
        need(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
             "max_model_len", "an integer >= 2 or unset")
        need(self.max_output_tokens is None or (_is_int(self.max_output_tokens) and self.max_output_tokens >= 1),
             "max_output_tokens", "an integer >= 1 or unset")
        need(self.api_key is None or bool(self.api_key), "api_key", "non-empty when set")
        need(_is_int(self.port) and 1 <= self.port <= 65535, "port", "a port number in [1, 65535]")
        need(self.replica_num_cpus > 0, "replica_num_cpus", "> 0")
        need(self.health_check_period_s > 0, "health_check_period_s", "> 0")
        need(self.image_fetch_timeout_s > 0, "image_fetch_timeout_s", "> 0")
        need(isinstance(self.image_url_hosts, (tuple, list)) and all(isinstance(h, str) for h in self.image_url_hosts),
             "image_url_hosts", "a list of hosts")
        object.__setattr__(self, "image_url_hosts", tuple(self.image_url_hosts))  # a Serve config's YAML list
        for entry in self.image_url_hosts:
            try:
                AllowedHost.parse(entry)
            except ValueError as e:
                raise SettingsError(f"{_flag('image_url_hosts')}: {e}") from None
        need(self.graceful_shutdown_timeout_s >= 0, "graceful_shutdown_timeout_s", ">= 0")
        need(not self.kv_sharing or bool(self.redis_url), "redis_url",
             f"a redis:// URL when KV sharing is on (or set {ENV_VARS['redis_url']})")
        need(not self.kv_sharing or self.enable_prefix_caching, "enable_prefix_caching",
             "true when KV sharing is on (shared blocks enter the prefix cache)")
        need(_is_int(self.host_kv_bytes) and self.host_kv_bytes >= 1, "host_kv_bytes", "an integer >= 1")
        need(bool(self.region), "region", "a non-empty name")

    def _check_shards(self) -> None:
        """A replica split over num_shards: a model the shards can split, its DSpark stages too when speculating
        (the checkpoint's config.json is read here; with one shard nothing is)."""
        try:
            check_shardable(load_config(self.checkpoint), self.num_shards, include_mtp=self.speculative_tokens > 0)
        except (OSError, ConfigError) as e:  # ShardingError is a ConfigError: it names the dimension
            raise SettingsError(f"--num-shards {self.num_shards}: {e}") from None

    @property
    def image_policy(self) -> ImagePolicy:
        return ImagePolicy(max_images=self.max_images, max_image_bytes=self.max_image_bytes,
                           max_image_pixels=self.max_image_pixels, max_request_image_bytes=self.max_request_image_bytes,
                           max_request_image_pixels=self.max_request_image_pixels,
                           url_hosts=tuple(AllowedHost.parse(h) for h in self.image_url_hosts),
                           fetch_timeout_s=self.image_fetch_timeout_s)

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_chunk_tokens=self.max_chunk_tokens, bounded_replay=self.bounded_replay,
                            max_prefill_beside_decode=self.max_prefill_beside_decode,
                            enable_prefix_caching=self.enable_prefix_caching,
                            cache_memory_bytes=self.cache_memory_bytes, max_model_len=self.max_model_len,
                            runner=self.runner, speculative_tokens=self.speculative_tokens)

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> "ServeSettings":
        """Flags (see `build_parser`), then ENV_VARS from `environ` (default os.environ), then defaults."""
        args = build_parser().parse_args(argv)
        return cls.from_mapping({k: v for k, v in vars(args).items() if v is not None}, environ)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], environ: Mapping[str, str] | None = None) -> "ServeSettings":
        """Field name -> value (strings are parsed, as from a Serve config's `args`), env vars filling gaps."""
        environ = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SettingsError(f"unknown setting {unknown[0]!r} (settings: {', '.join(sorted(known))})")
        out: dict[str, object] = {}
        for name in known:
            if name in values:
                raw, where = values[name], _flag(name)
            elif name in ENV_VARS and environ.get(ENV_VARS[name], "") != "":
                raw, where = environ[ENV_VARS[name]], ENV_VARS[name]
            else:
                continue
            out[name] = _PARSERS.get(name, _as_text)(raw, where) if isinstance(raw, str) else raw
        if "checkpoint" not in out:
            raise SettingsError(f"--checkpoint is required (or set {ENV_VARS['checkpoint']})")
        if out.get("device", "auto") == "auto":
            out["device"] = resolve_device()
        return cls(**out)


def resolve_device() -> Device:
    """'auto': cuda when this process sees a GPU. On a GPU-less head node of a GPU cluster pass --device cuda."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser() -> argparse.ArgumentParser:
    """Every flag defaults to None so that `from_mapping` can tell 'not given' from a value."""
    p = argparse.ArgumentParser(prog="dsv41-serve", description="Serve DeepSeek-V4.1 through Ray Serve.")
    env = {name: f" (env {var})" for name, var in ENV_VARS.items()}
    p.add_argument("--checkpoint", help="checkpoint folder, readable on every node" + env["checkpoint"])
    p.add_argument("--model-name", help=f"served model name (default {DEFAULT_MODEL_NAME})")
    p.add_argument("--num-replicas", help="engine replicas (default 1)")
    p.add_argument("--num-shards", help="model-parallel ranks per replica (default 1), one device each: tensor-parallel "
                   "attention, expert-parallel MoE; must divide the heads, output groups and experts")
    p.add_argument("--device", help="cpu, cuda or auto (default auto)" + env["device"])
    p.add_argument("--gpu-fraction", help="of one GPU each shard actor asks Ray for, in (0, 1] (default 1; cuda, one "
                   "shard): 0.5 fits two replicas on one GPU, each within its --cache-memory")
    p.add_argument("--cache-memory", dest="cache_memory_bytes",
                   help="KV cache budget per replica, bytes or e.g. 40GiB" + env["cache_memory_bytes"])
    p.add_argument("--max-num-seqs")
    p.add_argument("--max-num-batched-tokens")
    p.add_argument("--max-chunk-tokens")
    p.add_argument("--max-prefill-beside-decode", help="while a request decodes, a step's prefill chunks take at most "
                   "this many positions together (default: the step budget); bounds the inter-token latency of "
                   "streams while a long prompt prefills")
    p.add_argument("--max-model-len", help="context window cap (default: the model's)")
    p.add_argument("--bounded-replay", help="true or false (default true)")
    p.add_argument("--prefix-caching", dest="enable_prefix_caching", help="true or false (default true)")
    p.add_argument("--runner", help="auto, kernels or golden (default auto: the kernels on CUDA, the golden "
                   "float64 modules on CPU)")
    p.add_argument("--speculative-tokens", help="speculative decoding: DSpark drafts verified per step, at most the "
                   "checkpoint's DSpark block (default 0 = off; either runner; with --num-shards N, N must divide "
                   "the DSpark experts too)")
    p.add_argument("--api-key", help="require this bearer token" + env["api_key"])
    p.add_argument("--max-n", help="most choices per request (default 8)")
    p.add_argument("--max-messages", help="most messages per chat request (default 2048)")
    p.add_argument("--max-output-tokens", help="most max_tokens per request (default: the context window)")
    p.add_argument("--max-body-bytes", help="largest request body, bytes or e.g. 8MiB")
    p.add_argument("--max-prompt-chars", help="longest prompt text in characters, refused before tokenising "
                   "(default 4000000)")
    p.add_argument("--host")
    p.add_argument("--max-images", help="most images per chat request (default 8)")
    p.add_argument("--max-image-bytes", help="largest image, bytes or e.g. 20MiB (default 20MiB)")
    p.add_argument("--max-image-pixels", help="most pixels per image, from its header (default 7680 x 4320)")
    p.add_argument("--max-request-image-bytes", help="most image bytes per chat request, all images together, bytes "
                   "or e.g. 50MiB (default 50MiB)")
    p.add_argument("--max-request-image-pixels", help="most image pixels per chat request, all images together "
                   "(default 2 x 7680 x 4320)")
    p.add_argument("--image-url-hosts", help="comma-separated hosts whose http(s) image URLs the server fetches: "
                   "host or host:port (https only), http://host[:port] (plain http too); default none: image URLs "
                   "are refused" + env["image_url_hosts"])
    p.add_argument("--image-fetch-timeout-s", help="one image URL's fetch, connect to last byte (default 10)")
    p.add_argument("--port", help="HTTP port (default 8000)" + env["port"])
    p.add_argument("--max-ongoing-requests", help="per replica (default 64)")
    p.add_argument("--replica-num-cpus")
    p.add_argument("--health-check-period-s")
    p.add_argument("--graceful-shutdown-timeout-s")
    p.add_argument("--request-log-file", help="append the request_end JSON lines to this file too")
    p.add_argument("--kv-sharing", help="true or false (default false): share KV blocks between replicas")
    p.add_argument("--redis-url", help="the KV ownership index, redis://host:port/db" + env["redis_url"])
    p.add_argument("--host-kv-bytes", help="per-replica host store for shared blocks, bytes or e.g. 8GiB (default 1GiB)")
    p.add_argument("--region", help="this deployment's region (default local): pulls prefer owners in it")
    return p


# ---- strict parsers: (raw string, where it came from) -> value --------------------------------------------
_SIZE = re.compile(r"(\d+)\s*([KMGT]i?B?|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_int(raw: str, where: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", raw.strip()):
        raise SettingsError(f"{where}: expected an integer, got {raw!r}")
    return int(raw)


def parse_optional_int(raw: str, where: str) -> int | None:
    return None if raw.strip().lower() in ("", "none") else parse_int(raw, where)


def parse_float(raw: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{where}: expected a number, got {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingsError(f"{where}: expected a finite number, got {raw!r}")
    return value


def parse_bool(raw: str, where: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{where}: expected true or false, got {raw!r}")


def parse_bytes(raw: str, where: str) -> int:
    """'268435456', '256MiB', '40GiB', '1.5' is refused: whole numbers with K/M/G/T (1000) or Ki/Mi/Gi/Ti (1024)."""
    m = _SIZE.fullmatch(raw.strip())
    if m is None:
        raise SettingsError(f"{where}: expected a byte count like 268435456 or 40GiB, got {raw!r}")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(m.group(1)) * _UNITS[unit]


def parse_device(raw: str, where: str) -> str:
    value = raw.strip().lower()
    if value not in ("cpu", "cuda", "auto"):
        raise SettingsError(f"{where}: expected cpu, cuda or auto, got {raw!r}")
    return value


def parse_runner(raw: str, where: str) -> str:
    value = raw.strip().lower()
    if value not in RUNNER_KINDS:
        raise SettingsError(f"{where}: expected {', '.join(RUNNER_KINDS)}, got {raw!r}")
    return value


def parse_host_list(raw: str, where: str) -> tuple[str, ...]:
    """'a.example, http://10.0.0.5:8080' -> ('a.example', 'http://10.0.0.5:8080'); each entry checked by
    ServeSettings (AllowedHost.parse); empty: none."""
    return tuple(entry.strip() for entry in raw.split(",") if entry.strip())


def parse_optional_path(raw: str, where: str) -> str | None:
    return raw or None


def _as_text(raw: str, where: str) -> str:
    return raw


_PARSERS: dict[str, Callable[[str, str], object]] = {
    "num_replicas": parse_int, "num_shards": parse_int, "device": parse_device, "gpu_fraction": parse_float,
    "cache_memory_bytes": parse_bytes, "max_num_seqs": parse_int, "max_num_batched_tokens": parse_int,
    "max_chunk_tokens": parse_optional_int, "max_prefill_beside_decode": parse_optional_int,
    "max_model_len": parse_optional_int,
    "bounded_replay": parse_bool, "enable_prefix_caching": parse_bool, "max_n": parse_int, "max_messages": parse_int, "max_output_tokens": parse_optional_int,
    "max_body_bytes": parse_bytes, "max_prompt_chars": parse_int, "max_images": parse_int,
    "max_image_bytes": parse_bytes, "max_image_pixels": parse_int, "max_request_image_bytes": parse_bytes,
    "max_request_image_pixels": parse_int, "image_url_hosts": parse_host_list, "image_fetch_timeout_s": parse_float, "port": parse_int, "max_ongoing_requests": parse_int,
    "replica_num_cpus": parse_float, "health_check_period_s": parse_float,
    "graceful_shutdown_timeout_s": parse_float, "request_log_file": parse_optional_path,
    "kv_sharing": parse_bool, "redis_url": parse_optional_path, "host_kv_bytes": parse_bytes,
    "kv_same_node_reads": parse_bool,
    "runner": parse_runner, "speculative_tokens": parse_int,
}


def _flag(name: str) -> str:
    return {"cache_memory_bytes": "--cache-memory", "enable_prefix_caching": "--prefix-caching"}.get(
        name, "--" + name.replace("_", "-"))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
