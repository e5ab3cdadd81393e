"""OpenAI's API end to end: the real Serve app (ingress + EngineReplica on the tiny checkpoint, CPU), driven
with the `openai` client and httpx. What it streams is compared token by token with the offline engine
(same prompt ids, SamplingParams and seed); errors are checked for status and OpenAI's error schema.
One deployment serves the whole module (fixtures in api_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.core.sampling_params import SamplingParams
from tests.serve.api_fixtures import (API_KEY, MAX_BODY_BYTES, MAX_IN_FLIGHT, MAX_MODEL_LEN, MAX_N,  # noqa: F401
                                      SCRIPT, SCRIPT_CALL, SCRIPT_CONTENT, SCRIPT_REASONING, USER, api, api_settings,
                                      wait_idle,
                                      assert_error, chat_body, chat_prompt_ids, completion_body, mock_api,
                                      num_split_chars, post_stream, reference, run_offline, strings, visible_text)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the offline oracle runs torch in this process
MODEL = "deepseek-v4.1-flash"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def oai(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def assert_chat_logprobs(entries: list[dict], offline, strings, top: int) -> None:
    """Chat logprobs name each token by its exact bytes: they must be the offline ids' bytes, in order."""
    assert [bytes(e["bytes"]) for e in entries] == [strings.bytes(t) for t in offline.ids]
    assert [e["logprob"] for e in entries] == pytest.approx([lp.logprob for lp in offline.logprobs], abs=1e-5)
    assert all(len(e["top_logprobs"]) == top for e in entries)


# ---- auth and open routes --------------------------------------------------------------------------------
def test_auth_and_open_routes(api, oai):
    with httpx.Client(base_url=api.base_url, timeout=30) as bare:  # no key
        assert bare.get("/healthz").json() == {"status": "ok"}
        assert bare.get("/readyz").json() == {"ready": True}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}):
            assert_error(bare.get("/v1/models", headers=headers), 401, code="invalid_api_key",
                         type="authentication_error")
            r = bare.post("/v1/chat/completions", json=chat_body(), headers=headers)  # auth before validation
            assert_error(r, 401, code="invalid_api_key", type="authentication_error")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=api.base_url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert [m.id for m in oai.models.list()] == [MODEL]


# ---- chat ------------------------------------------------------------------------------------------------
def test_chat_with_openai_client_equals_offline_engine(api, oai, reference, strings):
    body = chat_body(temperature=1.0, seed=11, max_tokens=12)
    prompt = chat_prompt_ids(reference, body)
    [want] = run_offline(reference, {"c": (prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11,
                                                                   logprobs=2))})["c"]
    r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none", max_tokens=12,
                                    temperature=1.0, seed=11, logprobs=True, top_logprobs=2)
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content == visible_text(reference, want.ids)
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert_chat_logprobs([lp.model_dump() for lp in choice.logprobs.content], want, strings, top=2)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(want.ids))
    assert r.usage.total_tokens == len(prompt) + len(want.ids) and r.object == "chat.completion"
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_stream_equals_offline_engine_across_chunk_boundaries(api, oai, reference, strings):
    """Streamed text = decode(offline ids without EOS) and the logprobs name the offline ids in order. The
    seeds' outputs hold tokens that are partial UTF-8 characters (one of them last), so the held-back bytes
    must come out exactly once. Four streams at a time, so they share engine steps."""
    seeds = (1, 7, 13, 31)
    prompt = chat_prompt_ids(reference, chat_body())
    want = run_offline(reference, {f"s{s}": (prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=s,
                                                                     logprobs=1)) for s in seeds})
    bodies = [chat_body(temperature=1.0, seed=s, max_tokens=16, logprobs=True, top_logprobs=1,
                        stream_options={"include_usage": True}) for s in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        streams = list(pool.map(lambda b: post_stream(api.client, "/v1/chat/completions", b), bodies))
    for s, got in zip(seeds, streams):
        [offline] = want[f"s{s}"]
        assert num_split_chars(strings, offline.ids) > 0, f"seed {s} no longer splits a character: pick another"
        text = visible_text(reference, offline.ids)
        assert got.text() == text, f"seed {s}: streamed {got.text()!r}, offline {text!r}"
        assert got.choices()[0]["delta"] == {"role": "assistant", "content": ""}
        assert_chat_logprobs([e for c in got.choices() for e in (c["logprobs"] or {}).get("content", [])],
                             offline, strings, top=1)
        assert got.finish_reason() == ("length" if len(offline.ids) == 16 else "stop")
        assert got.events[-1]["choices"] == [] and got.usage["completion_tokens"] == len(offline.ids)
        assert {e["id"] for e in got.events} == {got.events[0]["id"]}
        assert all(e["object"] == "chat.completion.chunk" for e in got.events)

    chunks = list(oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none", max_tokens=16,
                                              temperature=1.0, seed=seeds[0], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == visible_text(reference,
                                                                                    want[f"s{seeds[0]}"][0].ids)


def test_n_choices_and_seed_reproducibility(api, oai, reference):
    body = chat_body(temperature=1.0, seed=5, n=3, max_tokens=6)
    [want] = run_offline(reference, {"n3": (chat_prompt_ids(reference, body),
                                            SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3))}).values()
    first = api.client.post("/v1/chat/completions", json=body).json()
    texts = [c["message"]["content"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert texts == [visible_text(reference, w.ids) for w in want] and len(set(texts)) == 3
    assert first["usage"]["completion_tokens"] == sum(len(w.ids) for w in want)
    again = api.client.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts
    other = api.client.post("/v1/chat/completions", json={**body, "seed": 6}).json()
    assert [c["message"]["content"] for c in other["choices"]] != texts, "another seed, other tokens"

    streamed = post_stream(api.client, "/v1/chat/completions", body)
    assert [streamed.text(i) for i in range(3)] == texts
    assert [streamed.finish_reason(i) for i in range(3)] == [c["finish_reason"] for c in first["choices"]]
    r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none", max_tokens=6,
                                    temperature=1.0, seed=5, n=3)
    assert [c.message.content for c in r.choices] == texts


def test_stop_strings(api):
    body = chat_body(temperature=1.0, seed=31, max_tokens=16)
    full = api.client.post("/v1/chat/completions", json=body).json()
    text = full["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = text[:text.find(stop)]
    got = api.client.post("/v1/chat/completions", json={**body, "stop": ["never-seen", stop]}).json()
    assert got["choices"][0]["message"]["content"] == want and got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
    streamed = post_stream(api.client, "/v1/chat/completions", {**body, "stop": stop})
    assert streamed.text() == want and streamed.finish_reason() == "stop"
    wait_idle(api)  # the engine request was aborted once the stop string was seen
    unseen = api.client.post("/v1/chat/completions", json={**body, "stop": "never-seen"}).json()
    assert unseen["choices"][0]["message"]["content"] == text and unseen["choices"][0]["finish_reason"] == "length"


def test_reasoning_and_tools_fields(api, oai, reference):
    """Thinking mode reports reasoning_content and reasoning_tokens; tools are rendered into the prompt (the
    random model writes no calls, so the message has none). The offline engine gives the same tokens."""
    body = chat_body(temperature=1.0, seed=3, max_tokens=8, reasoning_effort="high")
    [want] = run_offline(reference, {"think": (chat_prompt_ids(reference, body),
                                               SamplingParams(max_tokens=8, temperature=1.0, seed=3))})["think"]
    r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="high", max_tokens=8,
                                    temperature=1.0, seed=3)
    message = r.choices[0].message.model_dump()
    shown = visible_text(reference, want.ids)
    assert "</think>" not in shown, "this seed should not end its reasoning within 8 tokens"
    assert (message["reasoning_content"], message["content"]) == (shown, "")
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == len(want.ids)
    streamed = post_stream(api.client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert streamed.text(key="reasoning_content") == shown and streamed.text() == ""
    assert streamed.usage["completion_tokens_details"]["reasoning_tokens"] == len(want.ids)

    plain = chat_prompt_ids(reference, chat_body())
    with_tools = chat_prompt_ids(reference, chat_body(tools=TOOLS))
    assert len(with_tools) > len(plain) + 100
    r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none", max_tokens=4, tools=TOOLS,
                                    tool_choice="auto", temperature=0)
    assert r.usage.prompt_tokens == len(with_tools) and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length"
    none = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none", max_tokens=4, tools=TOOLS,
                                       tool_choice="none", temperature=0)
    assert none.usage.prompt_tokens == len(plain), "tool_choice none renders no tools"


# ---- completions -------------------------------------------------------------------------------------------
def test_completions_logprobs_name_the_offline_tokens(api, oai, reference, strings):
    prompt = list(range(1000, 1030))
    [want] = run_offline(reference, {"p": (prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=9,
                                                                  logprobs=3))})["p"]
    body = completion_body(prompt=prompt, max_tokens=10, temperature=1.0, seed=9, logprobs=3)
    r = api.client.post("/v1/completions", json=body).json()
    [choice] = r["choices"]
    assert choice["text"] == visible_text(reference, want.ids) and r["object"] == "text_completion"
    lp = choice["logprobs"]
    assert lp["tokens"] == [strings.text(t) for t in want.ids]
    assert lp["token_logprobs"] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
    assert all(tok in top and len(top) >= 3 for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert lp["text_offset"][0] == 0 and r["usage"]["prompt_tokens"] == 30
    assert r["usage"]["completion_tokens"] == len(want.ids)

    streamed = post_stream(api.client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert streamed.text() == choice["text"] and streamed.usage == r["usage"]
    merged = {k: [v for c in streamed.choices() if c["logprobs"] for v in c["logprobs"][k]] for k in lp}
    assert merged == lp, "streamed logprob blocks concatenate to the whole"

    text_prompt = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                         temperature=0)
    assert text_prompt.usage.prompt_tokens == len(reference.tokenizer.encode("The capital of France is"))
    assert text_prompt.choices[0].finish_reason == "length" and text_prompt.usage.completion_tokens == 5


# ---- disconnects and concurrency ---------------------------------------------------------------------------
def test_client_disconnect_frees_the_request(api):
    before = api.engine.metrics_snapshot.remote().result()
    with api.client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=250, stream=True)) as r:
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        assert [next(events)["choices"][0]["delta"] for _ in range(3)][0]["role"] == "assistant"  # + 2 texts
        assert api.engine.status.remote().result().num_running == 1
    waited = wait_idle(api)  # the response closed mid-stream: the connection is dropped
    print(f"disconnect -> engine idle in {waited:.2f} s")
    after = api.engine.metrics_snapshot.remote().result()
    key = "dsv41_request_total{finish_reason=abort}"
    assert after.get(key, 0) == before.get(key, 0) + 1, "the engine request was aborted, not run to its end"


def test_disconnect_before_the_first_token_frees_the_request(api):
    """A client that gives up while its prompt is computed: the engine request is aborted before its first
    token, and the ingress forgets it (it once stayed counted in flight: enough of these and every request
    got 429). MAX_IN_FLIGHT requests at once must then all be served."""
    def counts() -> tuple[float, float]:
        snap = api.engine.metrics_snapshot.remote().result()
        return snap.get("dsv41_request_total{finish_reason=abort}", 0), snap["dsv41_time_to_first_token_seconds_count"]

    def body(i: int, **fields) -> dict:  # ~300 distinct prompt tokens: no prefix-cache hits between tries
        return chat_body(messages=[{"role": "user", "content": f"{i} " + "word " * 290}], **fields)

    first_token_s = post_stream(api.client, "/v1/chat/completions", body(-1)).ttft  # routing + prefill
    num_early = 0
    for i in range(4):
        before = counts()
        try:  # the headers come with the first token: give up well before it
            api.client.post("/v1/chat/completions", json=body(i, stream=True),
                            timeout=httpx.Timeout(30, read=first_token_s / 3))
        except httpx.ReadTimeout:
            pass
        wait_idle(api)
        num_early += counts() == (before[0] + 1, before[1])
    assert num_early >= 1, "no try disconnected between the engine's admission and its first token"

    async def many() -> list[int]:
        async with httpx.AsyncClient(base_url=api.base_url, headers=api.client.headers, timeout=60,
                                     limits=httpx.Limits(max_connections=MAX_IN_FLIGHT)) as client:
            rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
                                        for _ in range(MAX_IN_FLIGHT)))
            return [r.status_code for r in rs]

    assert asyncio.run(many()) == [200] * MAX_IN_FLIGHT


@pytest.mark.parametrize("filters", [{"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.3}])
def test_a_tiny_temperature_is_greedy_and_the_replica_stays_up(api, reference, filters):
    """Issue 20's replica-killing request: temperature 1e-308 with a top-p/top-k/min-p cut overflowed the
    scaled logits and took the replica down for ~35 s. Below the floor it is greedy: the offline greedy text."""
    body = chat_body(max_tokens=4, temperature=1e-308, **filters)
    r = api.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [want] = run_offline(reference, {"g": (chat_prompt_ids(reference, body), SamplingParams(max_tokens=4))})["g"]
    assert r.json()["choices"][0]["message"]["content"] == visible_text(reference, want.ids)
    assert api.client.get("/readyz").status_code == 200


def test_32_concurrent_streams_complete(api, reference):
    prompts = {i: chat_body(messages=[{"role": "user", "content": f"Count to {i}."}], temperature=1.0, seed=i,
                            max_tokens=6, logprobs=True, stream=True, stream_options={"include_usage": True})
               for i in range(32)}
    want = run_offline(reference, {f"q{i}": (chat_prompt_ids(reference, b), SamplingParams(
        max_tokens=6, temperature=1.0, seed=i, logprobs=0)) for i, b in prompts.items()})

    async def one(client: httpx.AsyncClient, body: dict) -> tuple[str, int, dict]:
        text, num_tokens, usage = [], 0, None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for c in event["choices"]:
                    text.append(c["delta"].get("content") or "")
                    num_tokens += len((c["logprobs"] or {}).get("content", []))
        return "".join(text), num_tokens, usage

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=api.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, b) for b in prompts.values()))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    print(f"32 streams x 6 tokens in {time.monotonic() - t0:.1f} s")
    for i, (text, num_tokens, usage) in enumerate(results):
        [offline] = want[f"q{i}"]
        assert num_tokens == usage["completion_tokens"] == len(offline.ids), i
        assert text == visible_text(reference, offline.ids), i
    assert sum(r[2]["completion_tokens"] for r in results) == sum(len(w[0].ids) for w in want.values())
    wait_idle(api)


# ---- a scripted completion (MockEngine): reasoning, content, a tool call, characters split across tokens ----
def test_scripted_reasoning_content_and_tool_call(mock_api, reference, strings):
    script_ids = reference.tokenizer.encode(SCRIPT) + [reference.tokenizer.eos_id]
    assert num_split_chars(strings, script_ids) >= 7, "the emoji are split across tokens"
    oai = openai.OpenAI(base_url=mock_api + "/v1", api_key=API_KEY, max_retries=0)
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, reasoning_effort="high", max_tokens=200)
    r = oai.chat.completions.create(**kwargs, logprobs=True)
    message, choice = r.choices[0].message, r.choices[0]
    # the encoder's blank line before the calls block stays content, as vLLM's V4.1 parser keeps it
    assert (message.model_extra["reasoning_content"], message.content) == (SCRIPT_REASONING, SCRIPT_CONTENT + "\n\n")
    [call] = message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", *SCRIPT_CALL)
    assert choice.finish_reason == "tool_calls" and r.usage.completion_tokens == len(script_ids)
    reasoning_len = len(reference.tokenizer.encode(SCRIPT_REASONING + "</think>"))
    assert r.usage.completion_tokens_details.reasoning_tokens == reasoning_len
    assert [bytes(e.bytes) for e in choice.logprobs.content] == [strings.bytes(t) for t in script_ids]
    assert b"".join(strings.bytes(t) for t in script_ids[:-1]) == SCRIPT.encode()

    deltas = [c.choices[0].delta for c in oai.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == SCRIPT_REASONING
    assert "".join(d.content or "" for d in deltas) == SCRIPT_CONTENT + "\n\n"
    assert not any("\ufffd" in (d.content or "") + (d.model_extra.get("reasoning_content") or "") for d in deltas)
    first, *fragments = [t for d in deltas for t in d.tool_calls or []]  # id and name, then argument fragments
    assert (first.index, first.function.name, first.function.arguments) == (0, call.function.name, "")
    assert first.id.startswith("call_0_") and all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    assert "".join(f.function.arguments for f in fragments) == call.function.arguments

    cut = oai.chat.completions.create(**kwargs, stop=["龘"])  # a stop string made of two tokens' bytes
    assert cut.choices[0].message.content == "Checking " and cut.choices[0].finish_reason == "stop"
    text = oai.completions.create(model=MODEL, prompt="Weather?", max_tokens=200).choices[0]
    assert (text.text, text.finish_reason) == (SCRIPT, "stop"), "completions show the raw text, specials included"


# ---- bad requests ------------------------------------------------------------------------------------------
LONG_TEXT = "word " * (MAX_MODEL_LEN + 10)
CHAT_ERRORS = {  # name: (fields over chat_body(), status, param, code)
    "unknown model": ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    "model not a string": ({"model": 7}, 400, "model", None),
    "temperature type": ({"temperature": "hot"}, 400, "temperature", None),
    "temperature range": ({"temperature": 2.5}, 400, "temperature", None),
    "top_p zero": ({"top_p": 0}, 400, "top_p", None),
    "max_tokens zero": ({"max_tokens": 0}, 400, "max_tokens", None),
    "max_tokens string": ({"max_tokens": "8"}, 400, "max_tokens", None),
    "n above cap": ({"n": MAX_N + 1}, 400, "n", None),
    "n zero": ({"n": 0}, 400, "n", None),
    "n float": ({"n": 1.5}, 400, "n", None),
    "seed negative": ({"seed": -1}, 400, "seed", None),
    "stream type": ({"stream": "yes"}, 400, "stream", None),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    "top_logprobs range": ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    "reasoning_effort": ({"reasoning_effort": "extreme"}, 400, "reasoning_effort", None),
    "empty messages": ({"messages": []}, 400, "messages", None),
    "messages not a list": ({"messages": "hi"}, 400, "messages", None),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    "content type": ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    "tool_choice without tools": ({"tool_choice": "required"}, 400, "tool_choice", None),
    "presence_penalty": ({"presence_penalty": 0.5}, 400, "presence_penalty", None),
    "prompt above the window": ({"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages",
                                "context_length_exceeded"),
    "max_tokens above the window": ({"max_tokens": MAX_MODEL_LEN}, 400, "messages", "context_length_exceeded"),
}
COMPLETION_ERRORS = {
    "empty prompt": ({"prompt": ""}, 400, "prompt", None),
    "prompt type": ({"prompt": {"text": "hi"}}, 400, "prompt", None),
    "token id above the vocabulary": ({"prompt": [5, 10**7]}, 400, "prompt", None),
    "logprobs range": ({"logprobs": 6}, 400, "logprobs", None),
    "echo": ({"echo": True}, 400, "echo", None),
    "prompt above the window": ({"prompt": [100] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
}


@pytest.mark.parametrize("name", CHAT_ERRORS)
def test_chat_bad_request(api, name):
    fields, status, param, code = CHAT_ERRORS[name]
    assert_error(api.client.post("/v1/chat/completions", json=chat_body(**fields)), status, param, code)


@pytest.mark.parametrize("name", COMPLETION_ERRORS)
def test_completion_bad_request(api, name):
    fields, status, param, code = COMPLETION_ERRORS[name]
    assert_error(api.client.post("/v1/completions", json=completion_body(**fields)), status, param, code)


def test_malformed_and_oversized_bodies(api, oai):
    headers = {"Content-Type": "application/json"}
    for raw in (b'{"model": "deepseek-v4.1-flash", "messages": [', b"[1, 2]", b'{"temperature": NaN}', b"\xff\xfe"):
        assert_error(api.client.post("/v1/chat/completions", content=raw, headers=headers), 400)
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])).encode()
    error = assert_error(api.client.post("/v1/chat/completions", content=big, headers=headers), 413)
    assert str(MAX_BODY_BYTES) in error["message"]
    chunked = (big[i:i + 4096] for i in range(0, len(big), 4096))  # no Content-Length: counted as it arrives
    assert_error(api.client.post("/v1/chat/completions", content=chunked, headers=headers), 413)

    assert "Invalid URL" in assert_error(api.client.post("/v1/chat/complete", json=chat_body()), 404)["message"]
    assert_error(api.client.get("/v1/chat/completions"), 405)

    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=USER, n=MAX_N + 1)
    assert e.value.param == "n" and e.value.body["type"] == "invalid_request_error"
    wait_idle(api)  # nothing reached the engine


def test_openapi_json_has_the_request_body_schemas(api):
    """The served document is serve_app.schemas' (routes referencing the body schemas, n capped at this
    deployment's max_n); tests/serve/test_schemas.py checks those schemas against protocol.py."""
    from serve_app.ingress import app
    from serve_app.schemas import openapi_document

    served = api.client.get("/openapi.json").json()  # behind the key (tests/reliability/test_security.py)
    assert served == json.loads(json.dumps(openapi_document(app, max_n=MAX_N, model_names=[MODEL])))
    assert served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionBody"}
    assert served["components"]["schemas"]["CompletionBody"]["properties"]["n"]["anyOf"][0]["maximum"] == MAX_N


# ---- images (the embedded default has a vision tower) ------------------------------------------------------
def png(seed: int, side: int = 30, scale: int = 10) -> bytes:
    """side x side random pixels, each scale x scale: 300 x 300 (58 span tokens) in ~5 KB of PNG."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.repeat(scale, 0).repeat(scale, 1)).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def image_body(*urls: str, **fields) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "Describe."}]
    return chat_body(messages=[{"role": "user", "content": content}], temperature=0, logprobs=True, **fields)


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_two_images_give_different_greedy_outputs_and_a_repeat_hits_the_cache(api):
    outs = []
    for seed in (0, 1):
        r = api.client.post("/v1/chat/completions", json=image_body(data_url(png(seed))))
        assert r.status_code == 200, r.text
        outs.append(r.json())
    picks = [[(e["token"], e["logprob"]) for e in o["choices"][0]["logprobs"]["content"]] for o in outs]
    assert picks[0] != picks[1]
    usage = outs[0]["usage"]
    assert usage["prompt_tokens"] > 64  # the 58-token span expanded in the engine: one full 64-token block
    again = api.client.post("/v1/chat/completions", json=image_body(data_url(png(0)))).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    # (its text may differ from the first: a block hit rebuilds the window by encoder replay, spec 4.8)
    wait_idle(api)


def test_bad_images_are_400s(api):
    url = "messages[0].content[0].image_url.url"
    r = api.client.post("/v1/chat/completions", json=image_body("https://example.com/cat.png"))
    assert "does not fetch image URLs" in assert_error(r, 400, url, "image_url_not_supported")["message"]
    corrupt = png(0)[:200]  # the header, then the pixel data cut off
    error = assert_error(api.client.post("/v1/chat/completions", json=image_body(data_url(corrupt))), 400)
    assert error["message"].startswith("image 0: the PNG image cannot be decoded"), error
    big_bytes = png(3, side=80, scale=1)  # random pixels: ~19 KB, above the app's 16 KiB per image
    error = assert_error(api.client.post("/v1/chat/completions", json=image_body(data_url(big_bytes))), 400, url,
                         "image_too_large")
    assert f"limit of {16 << 10} bytes per image" in error["message"]
    big_pixels = png(4, side=1, scale=1100)  # 1100 x 1100 pixels of one colour: a few KB, above 1000 x 1000
    error = assert_error(api.client.post("/v1/chat/completions", json=image_body(data_url(big_pixels))), 400, url,
                         "image_too_large")  # refused by the ingress from the image's header
    assert "1100 x 1100 = 1210000 pixels, more than the limit of 1000000" in error["message"], error
    error = assert_error(api.client.post("/v1/chat/completions", json=image_body(*[data_url(png(0))] * 9)), 400,
                         "messages")
    assert "limit of 8 images per request" in error["message"]
    wait_idle(api)
