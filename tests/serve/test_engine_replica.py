"""EngineReplica through a real DeploymentHandle on an in-process Ray: streamed tokens equal the offline
engine's, n > 1 and seeds, readiness after warm-up, disconnects free the cache, rejected requests, the
request_end log line and the metrics. One deployment serves the whole module (its last test kills the
shard actor)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from engine.core.engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from serve_app.records import EngineRejected, GenerateChunk, GenerateRequest
from serve_app.settings import ServeSettings, SettingsError
from tests.serve.api_fixtures import run_replica

APP = "engine_replica_test"
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLED_N2 = SamplingParams(max_tokens=4, temperature=0.8, seed=7, n=2, ignore_eos=True)
LOG_FIELDS = {"event", "request_id", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "e2e_ms",
              "tok_per_s", "average_iteration_ms", "average_accept_length", "draft_tokens", "accepted_tokens",
              "finish_reason"}


@pytest.fixture(scope="module")
def settings(tiny_checkpoint, tmp_path_factory) -> ServeSettings:
    log = tmp_path_factory.mktemp("serve_logs") / "requests.jsonl"
    return ServeSettings(checkpoint=str(tiny_checkpoint), device="cpu", cache_memory_bytes=16 << 20,
                         max_num_batched_tokens=64, max_n=4, replica_num_cpus=1, health_check_period_s=60,
                         graceful_shutdown_timeout_s=1, request_log_file=str(log))


@pytest.fixture(scope="module")
def handle(serve_session, settings):
    from ray import serve

    yield run_replica(settings, APP)
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, settings) -> LLMEngine:
    return LLMEngine.from_checkpoint(tiny_checkpoint, settings.to_engine_config())


def stream(handle, request_id: str, prompt: list[int], params: SamplingParams):
    return handle.options(stream=True).generate.remote(GenerateRequest(request_id, prompt, params))


def by_choice(chunks: list[GenerateChunk]) -> dict[int, list[GenerateChunk]]:
    out: dict[int, list[GenerateChunk]] = {}
    for c in chunks:
        out.setdefault(c.choice_index, []).append(c)
    return out


def reference_choices(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> dict[int, list[int]]:
    engine.add_request(rid, prompt, params)
    out: dict[int, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.choice_index, []).extend(o.new_token_ids)
    return out


def wait_idle(handle, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        status = handle.status.remote().result()
        if status.num_running == 0 and status.num_waiting == 0:
            return status
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {status}"
        time.sleep(0.05)


def log_records(settings: ServeSettings) -> list[dict]:
    with open(settings.request_log_file) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_settings_parse_strictly():
    s = ServeSettings.from_cli(["--checkpoint", "/ckpt", "--cache-memory", "40GiB", "--prefix-caching", "false",
                                "--max-chunk-tokens", "128", "--device", "cpu"],
                               environ={"DSV41_API_KEY": "sk-secret-7", "DSV41_PORT": "9000", "DSV41_CACHE_MEMORY": "1GiB"})
    assert (s.cache_memory_bytes, s.port, s.api_key, s.enable_prefix_caching) == (40 << 30, 9000, "sk-secret-7", False)
    assert "sk-secret-7" not in repr(s), "the API key stays out of logs"
    assert s.to_engine_config().max_chunk_tokens == 128 and not s.to_engine_config().enable_prefix_caching
    assert s.to_engine_config().max_prefill_beside_decode is None
    capped = ServeSettings.from_cli(["--checkpoint", "/ckpt", "--max-prefill-beside-decode", "256"], environ={})
    assert capped.to_engine_config().max_prefill_beside_decode == 256
    assert s.runner == s.to_engine_config().runner == "auto"
    assert s.max_prompt_chars == 4_000_000
    assert ServeSettings.from_cli(["--checkpoint", "/ckpt", "--max-prompt-chars", "1000"], environ={}).max_prompt_chars == 1000
    forced = ServeSettings.from_cli(["--checkpoint", "/ckpt", "--runner", "Golden"], environ={})
    assert forced.to_engine_config().runner == "golden"
    spec = ServeSettings.from_cli(["--checkpoint", "/ckpt", "--speculative-tokens", "3"], environ={})
    assert spec.to_engine_config().speculative_tokens == 3 and s.to_engine_config().speculative_tokens == 0
    bad = {("--runner", "fast"): "--runner: expected auto, kernels, golden", ("--num-shards", "2"): "--num-shards 2: /ckpt: no config.json", ("--port", "80a"): "--port: expected an integer",
           ("--bounded-replay", "maybe"): "true or false", ("--device", "tpu"): "cpu, cuda or auto",
           ("--max-n", "0"): "--max-n must be an integer >= 1", ("--max-prompt-chars", "4M"): "--max-prompt-chars: expected an integer",
           ("--cache-memory", "12 potatoes"): "byte count",
           ("--speculative-tokens", "-1"): "--speculative-tokens must be an integer >= 0",
           ("--max-prefill-beside-decode", "0"): "--max-prefill-beside-decode must be an integer >= 1 or unset"}
    for (flag, value), message in bad.items():
        with pytest.raises(SettingsError, match=message):
            ServeSettings.from_cli(["--checkpoint", "/ckpt", flag, value], environ={})
    with pytest.raises(SettingsError, match="DSV41_PORT"):
        ServeSettings.from_cli(["--checkpoint", "/ckpt"], environ={"DSV41_PORT": "http"})
    with pytest.raises(SettingsError, match="--checkpoint is required"):
        ServeSettings.from_cli([], environ={})


def test_ready_after_warm_up(handle, settings):
    status = handle.status.remote().result()
    assert status.ready and status.model_name == settings.model_name
    assert status.max_model_len == 4096 and status.num_running == status.num_waiting == 0
    handle.check_health.remote().result()
    handle.check_integrity.remote().result()
    [shard] = handle.shard_info.remote().result()
    assert shard["device"] == "cpu" and shard["cache_bytes"] > 0 and shard["pid"] != os.getpid()
    assert shard["placement_group"] is not None, "the shard actor runs in the replica's placement group"


@pytest.mark.usefixtures("one_torch_thread")
def test_greedy_streams_equal_offline_engine(handle, reference):
    prompts = {"g0": list(range(200, 220)), "g1": [11, 12, 13, 14, 15]}
    gens = {rid: stream(handle, rid, p, GREEDY) for rid, p in prompts.items()}  # both run in one engine
    for rid, gen in gens.items():
        chunks = list(gen)
        want = reference.generate([prompts[rid]], GREEDY)[0]
        assert [t for c in chunks for t in c.token_ids] == want, rid
        assert [len(c.token_ids) for c in chunks] == [1] * len(want), "one token per chunk, none dropped or merged"
        assert [c.num_output_tokens for c in chunks] == list(range(1, len(want) + 1))
        assert [c.finish_reason for c in chunks] == [None] * (len(want) - 1) + ["length"]
        assert all(c.metrics is None for c in chunks[:-1])
        m = chunks[-1].metrics
        assert 0 < m.queue_s <= m.ttft_s <= m.e2e_s and m.num_iterations == len(want)
        assert m.average_iteration_ms > 0 and m.average_accept_length == 1.0 and m.num_preemptions == 0
        assert chunks[0].num_prompt_tokens == len(prompts[rid]) and chunks[0].num_cached_tokens == 0


@pytest.mark.usefixtures("one_torch_thread")
def test_n2_two_choices_and_seed_reproducibility(handle, reference):
    prompt = list(range(300, 317))
    first = by_choice(list(stream(handle, "n2-a", prompt, SAMPLED_N2)))
    again = by_choice(list(stream(handle, "n2-b", prompt, SAMPLED_N2)))
    assert sorted(first) == [0, 1]
    for index, chunks in first.items():
        assert [c.finish_reason for c in chunks][-1] == "length" and chunks[-1].metrics is not None
        assert sum(len(c.token_ids) for c in chunks) == SAMPLED_N2.max_tokens
    tokens = {i: [t for c in cs for t in c.token_ids] for i, cs in first.items()}
    assert tokens == {i: [t for c in cs for t in c.token_ids] for i, cs in again.items()}, "same seed, same tokens"
    assert tokens == reference_choices(reference, "n2-ref", prompt, SAMPLED_N2)
    assert tokens[0] != tokens[1], "the two choices sample with different seeds"


def test_bad_requests_raise_engine_rejected(handle):
    cases = {"vocab": ([5, 10**7], GREEDY, "outside the vocabulary"),
             "empty": ([], GREEDY, "empty"),
             "n": ([5, 6], SamplingParams(n=5), "n must be at most 4"),
             "temperature": ([5, 6], SamplingParams(temperature=3.0), "temperature")}
    for rid, (prompt, params, message) in cases.items():
        with pytest.raises(EngineRejected, match=message):
            list(stream(handle, rid, prompt, params))
    assert wait_idle(handle).num_running == 0
    handle.check_health.remote().result()


def test_cancelled_stream_frees_its_cache(handle, settings):
    before = handle.metrics_snapshot.remote().result()
    gen = stream(handle, "cancel-me", list(range(400, 430)), SamplingParams(max_tokens=2000, ignore_eos=True))
    got = [next(gen), next(gen)]
    assert handle.status.remote().result().num_running == 1
    t0 = time.monotonic()
    gen.cancel()
    wait_idle(handle)
    print(f"cancel -> idle in {time.monotonic() - t0:.2f} s")
    handle.check_integrity.remote().result()
    after = handle.metrics_snapshot.remote().result()
    key = "dsv41_request_total{finish_reason=abort}"
    assert after.get(key, 0) == before.get(key, 0) + 1
    [record] = [r for r in log_records(settings) if r["request_id"] == "cancel-me"]
    assert record["finish_reason"] == "abort" and len(got) <= record["completion_tokens"] < 2000


def test_ingress_disconnect_propagates_to_the_replica(handle):
    """The ingress's shape: a deployment streaming from the engine handle. Cancelling the call to it
    (what Serve does on an HTTP disconnect) must abort the engine request."""
    from ray import serve

    @serve.deployment
    class Relay:
        def __init__(self, engine):
            self.engine = engine

        async def stream(self, req: GenerateRequest):
            async for chunk in self.engine.options(stream=True).generate.remote(req):
                yield chunk

    relay = serve.run(Relay.bind(handle), name="relay_test", route_prefix=None)
    try:
        req = GenerateRequest("relay-cancel", list(range(500, 520)), SamplingParams(max_tokens=2000, ignore_eos=True))
        gen = relay.options(stream=True).stream.remote(req)
        next(gen), next(gen)
        gen.cancel()
        wait_idle(handle)
        handle.check_integrity.remote().result()
    finally:
        serve.delete("relay_test")


def test_request_end_log_and_metrics(handle, settings):
    chunks = list(stream(handle, "logged", [7, 8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True)))
    [record] = [r for r in log_records(settings) if r["request_id"] == "logged"]
    assert set(record) == LOG_FIELDS
    m = chunks[-1].metrics
    assert record["event"] == "request_end" and record["finish_reason"] == "length"
    assert (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) == (4, 0, 3)
    assert record["ttft_ms"] == pytest.approx(m.ttft_s * 1000, abs=1e-3)
    assert record["e2e_ms"] == pytest.approx(m.e2e_s * 1000, abs=1e-3)
    assert record["tok_per_s"] > 0 and record["average_accept_length"] == 1.0
    assert record["draft_tokens"] == record["accepted_tokens"] == 0
    n2 = [r["request_id"] for r in log_records(settings) if r["request_id"].startswith("n2-a")]
    assert sorted(n2) == ["n2-a", "n2-a/1"], "one line per choice"

    snap = handle.metrics_snapshot.remote().result()
    num_done = sum(v for k, v in snap.items() if k.startswith("dsv41_request_total{"))
    assert snap["dsv41_request_total{finish_reason=length}"] >= 7  # g0, g1, n2-a x2, n2-b x2, logged
    assert snap["dsv41_e2e_request_latency_seconds_count"] == num_done  # every choice here got a token
    assert snap["dsv41_time_to_first_token_seconds_count"] >= 5
    assert snap["dsv41_generation_tokens_total"] >= 2 * GREEDY.max_tokens + 4 * 4 + 3
    assert snap["dsv41_inter_token_latency_seconds_count"] > 0
    assert snap["dsv41_prompt_tokens_total"] >= 20 + 5 + 17 + 17 + 4
    assert snap["dsv41_num_requests_running"] == 0 and 0 <= snap["dsv41_kv_cache_usage_ratio"] <= 1
    assert "dsv41_prefix_cache_hit_rate" in snap


def test_dead_shard_fails_health_and_requests(handle):
    [shard] = handle.shard_info.remote().result()
    os.kill(shard["pid"], signal.SIGKILL)
    [last] = list(stream(handle, "after-death", [1, 2, 3], GREEDY))  # ends cleanly, with the reason
    assert last.finish_reason == "error" and last.token_ids == [] and re.search("ActorDied|actor|died", last.error)
    with pytest.raises(Exception, match="cannot serve.*(ActorDied|actor|died)"):
        handle.check_health.remote().result()
    assert not handle.status.remote().result().ready
    with pytest.raises(Exception, match="replica is failing"):
        list(stream(handle, "refused", [1, 2, 3], GREEDY))
