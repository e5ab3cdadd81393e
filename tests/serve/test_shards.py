"""A replica split over two shard actors (`--num-shards 2`) through OpenAI's API: the official openai client
gets one shard's greedy text (the offline engine in this process, one shard: the oracle), streamed text equals
unstreamed; the two ShardWorker actors are ranks 0 and 1 in the replica's placement group, map one shared copy of
the Engram tables, and give it up when the app goes. `--num-shards 4` is refused when the settings are built,
naming the dimension. (A rank killed under load: tests/reliability/test_shard_faults.py.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from engine.core.engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from serve_app.__main__ import check_speculative_settings
from serve_app.__main__ import main as serve_main
from serve_app.settings import ServeSettings, SettingsError
from tests.serve.api_fixtures import chat_body, chat_prompt_ids, run_offline, visible_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the offline oracle runs torch in this process
APP, PREFIX = "shards_test", "/shards"
API_KEY = "sk-shards-test"
MODEL = "deepseek-v4.1-flash"
MESSAGES = ["Say hello in three languages.", "Count to five.", "What is a shard?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def settings(tiny_checkpoint) -> ServeSettings:
    return ServeSettings(checkpoint=str(tiny_checkpoint), device="cpu", num_shards=2, cache_memory_bytes=16 << 20,
                         max_num_seqs=8, max_num_batched_tokens=256, max_model_len=320, api_key=API_KEY,
                         replica_num_cpus=0.5, health_check_period_s=60, graceful_shutdown_timeout_s=15)


@pytest.fixture(scope="module")
def app(serve_session, settings) -> Iterator[tuple[str, object]]:
    """(base URL, the EngineReplica's handle) of the app with two shards per replica."""
    from ray import serve

    from serve_app.app import build_app

    t0 = time.monotonic()
    serve.run(build_app(settings), name=APP, route_prefix=PREFIX)
    base_url = f"http://127.0.0.1:{serve_session}{PREFIX}"
    deadline = time.monotonic() + 60
    while httpx.get(base_url + "/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the two-shard app did not become ready in 60 s"
        time.sleep(0.2)
    print(f"\ntwo-shard app deployed and ready in {time.monotonic() - t0:.1f} s")
    yield base_url, serve.get_deployment_handle("EngineReplica", APP)
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, settings) -> LLMEngine:
    return LLMEngine.from_checkpoint(tiny_checkpoint, settings.to_engine_config())


def test_two_shards_answer_with_one_shards_greedy_text(app, reference):
    base_url, _ = app
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    bodies = [chat_body(messages=[{"role": "user", "content": m}], max_tokens=MAX_TOKENS, temperature=0)
              for m in MESSAGES]
    want = run_offline(reference, {str(i): (chat_prompt_ids(reference, b), SamplingParams(max_tokens=MAX_TOKENS))
                                   for i, b in enumerate(bodies)})
    texts = [visible_text(reference, want[str(i)][0].ids) for i in range(len(bodies))]
    assert len(set(texts)) == len(texts) and all(texts), texts

    def unstreamed(m: str) -> str:
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": m}],
                                        reasoning_effort="none", max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content

    def streamed(m: str) -> str:
        chunks = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": m}],
                                             reasoning_effort="none", max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(2 * len(MESSAGES)) as pool:  # all at once: they share the group's steps
        plain = pool.map(unstreamed, MESSAGES)
        streams = pool.map(streamed, MESSAGES)
        plain, streams = list(plain), list(streams)
    assert plain == texts
    assert streams == texts


def test_the_shards_are_two_ranks_mapping_one_copy_of_the_engram_tables(app):
    _, handle = app
    infos = handle.shard_info.remote().result()
    assert [i["rank"] for i in infos] == [0, 1] and {i["num_shards"] for i in infos} == {2}
    assert len({i["pid"] for i in infos}) == 2 and infos[0]["placement_group"] is not None
    assert infos[0]["placement_group"] == infos[1]["placement_group"], "both in the replica's placement group"
    memory = [i["memory"] for i in infos]
    assert all(m["engram_shared"] and m["engram_bytes"] > 0 for m in memory), memory
    assert memory[0]["engram_file"] == memory[1]["engram_file"] and memory[0]["engram_inode"] == memory[1]["engram_inode"]
    shared = Path(memory[0]["engram_file"])
    assert shared.parent == Path("/dev/shm") and shared.stat().st_ino == memory[0]["engram_inode"]
    assert all(m["weights_bytes"] > 0 and m["kv_bytes"] == i["cache_bytes"] for m, i in zip(memory, infos))


def test_deleting_the_app_gives_up_the_shared_tables(app):
    from ray import serve

    _, handle = app
    shared = Path(handle.shard_info.remote().result()[0]["memory"]["engram_file"])
    assert shared.exists()
    serve.delete(APP)
    deadline = time.monotonic() + 30
    while shared.exists():  # no one else maps them: the last shard to close unlinks them
        assert time.monotonic() < deadline, f"{shared} still there 30 s after the app was deleted"
        time.sleep(0.1)


def test_four_shards_are_refused_when_the_settings_are_built(tiny_checkpoint, capsys):
    with pytest.raises(SettingsError, match="--num-shards 4: o_groups=2 is not divisible by 4 shards"):
        ServeSettings.from_cli(["--checkpoint", str(tiny_checkpoint), "--num-shards", "4"], environ={})
    kernels = ServeSettings.from_cli(["--checkpoint", str(tiny_checkpoint), "--num-shards", "2", "--runner", "kernels"],
                                     environ={})
    assert (kernels.num_shards, kernels.runner) == (2, "kernels")  # either runner splits
    assert ServeSettings.from_cli(["--checkpoint", str(tiny_checkpoint), "--num-shards", "2"], environ={}).num_shards == 2
    speculative = ServeSettings.from_cli(["--checkpoint", str(tiny_checkpoint), "--num-shards", "2",
                                          "--speculative-tokens", "2"], environ={})
    assert (speculative.num_shards, speculative.speculative_tokens) == (2, 2)  # the DSpark stages split too
    # the kernel runner speculates over several shards too; a K past the DSpark block is refused before Ray
    kernel_spec = ["--checkpoint", str(tiny_checkpoint), "--num-shards", "2", "--runner", "kernels"]
    assert check_speculative_settings(ServeSettings.from_cli(kernel_spec + ["--speculative-tokens", "2"],
                                                             environ={})) is None
    assert serve_main(kernel_spec + ["--speculative-tokens", "4"]) == 2
    assert "past the checkpoint's DSpark block of 3 tokens" in capsys.readouterr().err
    assert serve_main(["--checkpoint", str(tiny_checkpoint), "--num-shards", "4"]) == 2  # make serve: before Ray
    assert "o_groups=2 is not divisible by 4 shards" in capsys.readouterr().err


def test_speculating_over_shards_needs_the_dspark_experts_to_split(tiny_checkpoint, tmp_path):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["text_config"]["dspark_n_routed_experts"] = 3  # only config.json is read when the settings are built
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags = ["--checkpoint", str(tmp_path), "--num-shards", "2"]
    assert ServeSettings.from_cli(flags, environ={}).num_shards == 2  # no speculation: no DSpark stages loaded
    with pytest.raises(SettingsError, match="--num-shards 2: dspark_n_routed_experts=3 is not divisible by 2 shards"):
        ServeSettings.from_cli(flags + ["--speculative-tokens", "2"], environ={})
