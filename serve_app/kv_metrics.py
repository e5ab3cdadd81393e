"""Cross-replica KV sharing metrics (ray.util.metrics, exported as `ray_dsv41_kv_*` next to
serve_app/metrics.py's series, so Ray's dashboard and `/metrics` show them). Like ServeMetrics, every
update also lands in a local tally that `snapshot()` returns."""

from __future__ import annotations

from serve_app.metrics import MetricSet

_PULL_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class KVMetrics(MetricSet):
    def __init__(self, model_name: str):
        super().__init__(model_name)
        counter = self.counter

        self.pulls = counter("dsv41_kv_pulls_total", "Prefixes pulled from another replica and imported.")
        self.pull_bytes = counter("dsv41_kv_pull_bytes_total", "Bytes of global KV blocks pulled.")
        self.pull_latency = self.histogram(
            "dsv41_kv_pull_latency_seconds", "Ownership lookup + NIXL read + checksums + import, per pull.", _PULL_S)
        self.fallbacks = counter("dsv41_kv_pull_fallbacks_total", "Pulls the router asked for that fell back to "
                                 "recomputation, by reason.", ("reason",))
        self.hit_tokens = counter("dsv41_kv_hit_tokens_total", "Prompt tokens served from cached KV, by where "
                                  "it came from: local (this replica) or remote (pulled).", ("source",))
        self.published = counter("dsv41_kv_published_blocks_total", "Blocks newly stored and published.")
        self.publish_failures = counter("dsv41_kv_publish_failures_total", "Publishes or lease renewals that "
                                        "failed, by reason.", ("reason",))
        self.decisions = counter("dsv41_kv_route_decisions_total", "The KV router's decisions.", ("decision",))

    def observe_pull(self, num_bytes: int, seconds: float) -> None:
        self._inc(self.pulls, "dsv41_kv_pulls_total", 1)
        self._inc(self.pull_bytes, "dsv41_kv_pull_bytes_total", num_bytes)
        self._observe(self.pull_latency, "dsv41_kv_pull_latency_seconds", seconds)

    def observe_fallback(self, reason: str) -> None:
        self._inc(self.fallbacks, "dsv41_kv_pull_fallbacks_total", 1, {"reason": reason})

    def observe_hits(self, num_local: int, num_remote: int) -> None:
        self._inc(self.hit_tokens, "dsv41_kv_hit_tokens_total", num_local, {"source": "local"})
        self._inc(self.hit_tokens, "dsv41_kv_hit_tokens_total", num_remote, {"source": "remote"})

    def observe_published(self, num_blocks: int) -> None:
        self._inc(self.published, "dsv41_kv_published_blocks_total", num_blocks)

    def observe_publish_failure(self, reason: str) -> None:
        self._inc(self.publish_failures, "dsv41_kv_publish_failures_total", 1, {"reason": reason})

    def observe_decision(self, decision: str) -> None:
        self._inc(self.decisions, "dsv41_kv_route_decisions_total", 1, {"decision": decision})
