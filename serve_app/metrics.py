"""The replica's Prometheus metrics (ray.util.metrics; exported with Ray's `ray_` prefix) and its
`request_end` JSON log line.

Every metric is tagged with the served model name. Each one also keeps a local tally (counter totals,
histogram count and sum, gauge value) that `ServeMetrics.snapshot()` returns: what this replica
recorded, readable without scraping Ray's metrics agent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from ray.util import metrics as ray_metrics

from serve_app.records import RequestMetrics

REQUEST_LOGGER = "dsv41.request"

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_ITL_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5]
_ACCEPT = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0]
_E2E_S = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]


class _Tally:
    """The local mirror: name (with sorted tags) -> value."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, key: str, value: float) -> None:
        self.values[key] = value


def _key(name: str, tags: dict[str, str] | None) -> str:
    return name if not tags else name + "{" + ",".join(f"{k}={v}" for k, v in sorted(tags.items())) + "}"


class MetricSet:
    """Ray metrics tagged with the served model name, each update mirrored in a local tally."""

    def __init__(self, model_name: str):
        self.tally = _Tally()
        self._default_tags = {"model": model_name}

    def counter(self, name: str, description: str, tag_keys: Sequence[str] = ()):
        return self._made(ray_metrics.Counter(name, description, tag_keys=("model", *tag_keys)))

    def histogram(self, name: str, description: str, boundaries: list[float]):
        return self._made(ray_metrics.Histogram(name, description, boundaries=boundaries, tag_keys=("model",)))

    def gauge(self, name: str, description: str):
        return self._made(ray_metrics.Gauge(name, description, tag_keys=("model",)))

    def snapshot(self) -> dict[str, float]:
        """Counter totals as `name{tags}`, histograms as `name_count` / `name_sum`, gauges' last values."""
        return dict(self.tally.values)

    def _made(self, metric):
        metric.set_default_tags(self._default_tags)
        return metric

    def _inc(self, metric, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if value:
            metric.inc(value, tags=tags)
            self.tally.add(_key(name, tags), value)

    def _observe(self, metric, name: str, value: float) -> None:
        metric.observe(value)
        self.tally.add(name + "_count", 1)
        self.tally.add(name + "_sum", value)


class ServeMetrics(MetricSet):
    def __init__(self, model_name: str):
        super().__init__(model_name)
        counter, histogram, gauge = self.counter, self.histogram, self.gauge

        self.ttft = histogram("dsv41_time_to_first_token_seconds", "Arrival at the engine to the first token.",
                              _LATENCY_S)
        self.itl = histogram("dsv41_inter_token_latency_seconds", "Time between a choice's successive tokens.",
                             _ITL_S)
        self.e2e = histogram("dsv41_e2e_request_latency_seconds", "Arrival to the finish of one choice.", _E2E_S)
        self.accept_length = histogram("dsv41_spec_accept_length", "Speculative decoding: a finished choice's "
                                       "tokens per verify step (accepted drafts + 1).", _ACCEPT)
        self.prompt_tokens = counter("dsv41_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("dsv41_generation_tokens_total", "Tokens generated (all choices).")
        self.cached_tokens = counter("dsv41_cached_prompt_tokens_total", "Prompt tokens served from the prefix cache.")
        self.requests = counter("dsv41_request_total", "Finished choices by finish reason.", ("finish_reason",))
        self.running = gauge("dsv41_num_requests_running", "Requests the scheduler is running.")
        self.waiting = gauge("dsv41_num_requests_waiting", "Requests waiting for admission.")
        self.cache_usage = gauge("dsv41_kv_cache_usage_ratio", "Fraction of global KV blocks in use.")
        self.prefix_hit_rate = gauge("dsv41_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache, "
                                     "as a fraction of those looked up (since start).")

    # ---- recording (each call updates the Ray metric and the local tally) --------------------------------
    def observe_first_token(self, ttft_s: float) -> None:
        self._observe(self.ttft, "dsv41_time_to_first_token_seconds", ttft_s)

    def observe_tokens(self, num_tokens: int, inter_token_s: float | None) -> None:
        self._inc(self.generation_tokens, "dsv41_generation_tokens_total", num_tokens)
        if inter_token_s is not None:
            self._observe(self.itl, "dsv41_inter_token_latency_seconds", inter_token_s)

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self._inc(self.prompt_tokens, "dsv41_prompt_tokens_total", num_prompt_tokens)
        self._inc(self.cached_tokens, "dsv41_cached_prompt_tokens_total", num_cached_tokens)

    def observe_finish(self, finish_reason: str, e2e_s: float | None) -> None:
        self._inc(self.requests, "dsv41_request_total", 1, {"finish_reason": finish_reason})
        if e2e_s is not None:
            self._observe(self.e2e, "dsv41_e2e_request_latency_seconds", e2e_s)

    def observe_accept_length(self, tokens_per_step: float) -> None:
        self._observe(self.accept_length, "dsv41_spec_accept_length", tokens_per_step)

    def set_engine_state(self, num_running: int, num_waiting: int, cache_usage: float, prefix_hit_rate: float) -> None:
        for metric, name, value in ((self.running, "dsv41_num_requests_running", num_running),
                                    (self.waiting, "dsv41_num_requests_waiting", num_waiting),
                                    (self.cache_usage, "dsv41_kv_cache_usage_ratio", cache_usage),
                                    (self.prefix_hit_rate, "dsv41_prefix_cache_hit_rate", prefix_hit_rate)):
            metric.set(value)
            self.tally.set(name, float(value))


# ---- the request_end log line ---------------------------------------------------------------------------
def request_logger(log_file: str | None) -> logging.Logger:
    """The `dsv41.request` logger at INFO: bare JSON lines to stderr (the replica's log) and to log_file."""
    logger = logging.getLogger(REQUEST_LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    wanted = [("stderr", None)] + ([("file", log_file)] if log_file else [])
    for kind, target in wanted:
        if any(getattr(h, "_dsv41", None) == (kind, target) for h in logger.handlers):
            continue
        handler = logging.StreamHandler() if kind == "stderr" else logging.FileHandler(target, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._dsv41 = (kind, target)
        logger.addHandler(handler)
    return logger


def request_end_record(request_id: str, num_prompt_tokens: int, num_cached_tokens: int, num_completion_tokens: int,
                       metrics: RequestMetrics, finish_reason: str) -> dict[str, object]:
    """tok_per_s is the decode rate after the first token: (completion - 1) / (e2e - ttft); with a single
    token it is completion / e2e. A NaN time (an aborted choice that got no token) becomes null."""
    decode_s = metrics.e2e_s - metrics.ttft_s
    if num_completion_tokens > 1 and decode_s > 0:
        tok_per_s = (num_completion_tokens - 1) / decode_s
    else:
        tok_per_s = num_completion_tokens / metrics.e2e_s if metrics.e2e_s > 0 else 0.0
    return {"event": "request_end", "request_id": request_id, "prompt_tokens": num_prompt_tokens,
            "cached_tokens": num_cached_tokens, "completion_tokens": num_completion_tokens,
            "ttft_ms": _ms(metrics.ttft_s), "e2e_ms": _ms(metrics.e2e_s), "tok_per_s": _round(tok_per_s),
            "average_iteration_ms": _round(metrics.average_iteration_ms),
            "average_accept_length": _round(metrics.average_accept_length), "draft_tokens": metrics.num_draft_tokens,
            "accepted_tokens": metrics.num_accepted_tokens, "finish_reason": finish_reason}


def log_request_end(logger: logging.Logger, record: dict[str, object]) -> None:
    logger.info(json.dumps(record, separators=(",", ":")))


def _round(x: float) -> float | None:
    return None if x != x else round(x, 3)


def _ms(seconds: float) -> float | None:
    return _round(seconds * 1000)
