"""EngineReplica with speculative decoding on (SERVE_ARGS="--speculative-tokens K"): the DSpark stages load in the
shard actor, greedy streams equal the engine's without drafts, usage counts are exact, and every choice's accept
length reaches its request_end line and the dsv41_spec_accept_length histogram."""

from __future__ import annotations

import json

import pytest

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from serve_app.records import GenerateRequest
from serve_app.settings import ServeSettings
from tests.serve.api_fixtures import run_replica

APP = "engine_replica_spec_test"
K = 2


@pytest.fixture(scope="module")
def settings(tiny_checkpoint, tmp_path_factory) -> ServeSettings:
    log = tmp_path_factory.mktemp("serve_spec_logs") / "requests.jsonl"
    return ServeSettings(checkpoint=str(tiny_checkpoint), device="cpu", cache_memory_bytes=16 << 20,
                         max_num_batched_tokens=64, replica_num_cpus=1, health_check_period_s=60,
                         graceful_shutdown_timeout_s=1, request_log_file=str(log), speculative_tokens=K)


@pytest.fixture(scope="module")
def handle(serve_session, settings):
    from ray import serve

    yield run_replica(settings, APP, "EngineReplica (speculative)")
    serve.delete(APP)


@pytest.mark.usefixtures("one_torch_thread")
def test_speculative_replica_streams_the_target_tokens_and_reports_accept_length(handle, settings, tiny_checkpoint):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(200, 220))
    chunks = list(handle.options(stream=True).generate.remote(GenerateRequest("spec", prompt, params)))
    plain = LLMEngine.from_checkpoint(tiny_checkpoint, EngineConfig(max_num_batched_tokens=64))
    want = plain.generate([prompt], params)[0]
    assert [t for c in chunks for t in c.token_ids] == want
    assert chunks[-1].num_output_tokens == len(want) and chunks[-1].finish_reason == "length"
    assert [c.num_output_tokens for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i + 1])
                                                     for i in range(len(chunks))], "usage counts every token once"
    m = chunks[-1].metrics
    assert m.num_draft_tokens > 0 and 1.0 <= m.average_accept_length <= 1 + K
    with open(settings.request_log_file) as f:
        [record] = [r for r in map(json.loads, f) if r["request_id"] == "spec"]
    assert (record["draft_tokens"], record["accepted_tokens"]) == (m.num_draft_tokens, m.num_accepted_tokens)
    assert record["average_accept_length"] == pytest.approx(m.average_accept_length, abs=1e-3)
    snap = handle.metrics_snapshot.remote().result()
    assert snap["dsv41_spec_accept_length_count"] >= 1
    handle.check_integrity.remote().result()


def test_serve_refuses_k_past_the_dspark_block_before_starting_ray(tiny_checkpoint, capsys):
    from serve_app.__main__ import main

    assert main(["--checkpoint", str(tiny_checkpoint), "--speculative-tokens", "4"]) == 2
    err = capsys.readouterr().err
    # stderr may also hold an earlier test's Ray replica logs (they stream to the driver): the error is its own line
    assert any(line.startswith("error:") and "DSpark block of 3 tokens" in line for line in err.splitlines()), err
