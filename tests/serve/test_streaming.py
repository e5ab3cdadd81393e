"""serve_app.streaming with the real V4.1 tokenizer: exact incremental detokenization (multi-byte
characters split across tokens, random id sequences, every chunking), stop strings across token and
chunk boundaries, and chat streams whose deltas reassemble to the whole-text parse."""

from __future__ import annotations

import json
import random

import pytest
from openai.types.chat import ChatCompletionChunk

from engine.chat import parse_completion, syntax
from serve_app.protocol import chat_chunk, chat_stream_choice
from serve_app.streaming import (
    SSE_DONE,
    ChatChoiceStream,
    CompletionChoiceStream,
    IncrementalDetokenizer,
    StopChecker,
    TokenStrings,
    sse_event,
)

THINK_END_ID = 128822
MULTILINGUAL = "你好🙂 héllo 日本語のテキスト 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 Ωμέγα ∑∫ 🇫🇷 عربى"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
CALLS = syntax.render_tool_calls([("get_weather", {"location": "北京", "days": 3}),
                                  ("get_time", {"tz": "Asia/Shanghai"})])
# (thinking, completion text as the model writes it after the prompt; the EOS token is appended)
CHAT_TEXTS = [
    (True, "用户想知道北京的天气🙂, so I should call get_weather.</think>Let me check — 北京 🌤️." + CALLS),
    (False, "Sure 👍" + CALLS + "\n\nAnything else? 😀"),
    (True, "Still thinking 🤔 <｜DSML｜ calls> about it"),  # never closed: all reasoning
    (False, 'Broken: <｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ calls> done'),  # malformed: content
]


@pytest.fixture(scope="module")
def fragment_ids(tok) -> list[int]:
    """Ids of tokens that are not whole UTF-8 text on their own (pieces of multi-byte characters)."""
    ids = sorted({i for i in tok.encode(MULTILINGUAL) if "\ufffd" in tok.decode([i])})
    assert len(ids) >= 10
    return ids


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


# --- TokenStrings --------------------------------------------------------------------------------


def test_token_bytes_are_exact(tok):
    strings = TokenStrings(tok)
    ids = tok.encode(MULTILINGUAL)
    assert b"".join(strings.bytes(i) for i in ids) == MULTILINGUAL.encode("utf-8")
    rng = random.Random(0)
    sample = rng.sample(range(tok.vocab_size), 3000) + list(range(128790, 128850)) + [0, 1, 2]
    for i in sample:
        assert strings.bytes(i).decode("utf-8", errors="replace") == tok.decode([i]) == strings.text(i), i


# --- IncrementalDetokenizer ----------------------------------------------------------------------


def test_emoji_split_across_tokens_is_held_back(tok):
    ids = tok.encode("你好🙂")
    assert tok.decode(ids[1:2]).endswith("\ufffd")  # the emoji's bytes really are split
    detok = IncrementalDetokenizer(tok)
    outs = [detok.add([i]) for i in ids]
    assert outs == ["你好", "", "🙂"] and detok.finish() == ""


def test_incomplete_character_is_flushed_at_finish(tok):
    (first, _), = [tok.encode("🙂")]
    detok = IncrementalDetokenizer(tok)
    assert detok.add([tok.encode("a")[0], first]) == "a"
    assert detok.finish() == tok.decode([first])[-1:] == "\ufffd"


def test_every_split_point_of_multibyte_text(tok):
    ids = tok.encode(MULTILINGUAL)
    full = tok.decode(ids)
    assert full == MULTILINGUAL
    for a in range(len(ids) + 1):
        for b in range(a, len(ids) + 1):
            detok = IncrementalDetokenizer(tok)
            parts = [detok.add(ids[:a]), detok.add(ids[a:b]), detok.add(ids[b:]), detok.finish()]
            assert "".join(parts) == full, (a, b, parts)
            assert all("\ufffd" not in part for part in parts), (a, b, parts)


def test_random_ids_in_random_chunks_decode_exactly(tok, fragment_ids):
    """Property: any id sequence (invalid UTF-8 and special tokens included) fed in any chunking
    gives exactly decode(ids)."""
    rng = random.Random(1)
    special = [0, 1, 128799, 128821, 128822, 128825]
    for trial in range(300):
        ids = [rng.choice(fragment_ids) if r < 0.6 else rng.choice(special) if r < 0.7 else rng.randrange(tok.vocab_size)
               for r in (rng.random() for _ in range(rng.randint(0, 40)))]
        detok = IncrementalDetokenizer(tok)
        out = "".join(detok.add(chunk) for chunk in random_chunks(ids, rng)) + detok.finish()
        assert out == tok.decode(ids), (trial, ids)


# --- StopChecker ---------------------------------------------------------------------------------


def test_stop_string_split_across_chunks():
    stop = StopChecker(["STOP"])
    assert stop.feed("abc ST") == "abc "  # "ST" could start "STOP": held
    assert stop.feed("OP def") == "" and stop.is_hit
    assert stop.feed("more") == "" and stop.finish() == ""


def test_held_text_is_released_when_no_stop_follows():
    stop = StopChecker(["STOP", "\n\n"])
    assert stop.feed("abc ST") == "abc "
    assert stop.feed("ART\n") == "START"
    assert stop.finish() == "\n" and not stop.is_hit


def test_first_completed_stop_string_wins():
    stop = StopChecker(["cd", "bcde"])
    assert stop.feed("ab") == "a"
    assert stop.feed("cdef") == "b" and stop.is_hit  # "cd" is complete before "bcde" is
    assert StopChecker(["xyz", "b"]).feed("abxyz") == "a"
    assert StopChecker(["cd", "bcd"]).feed("abcd") == "a"  # both end together: the longer one
    assert StopChecker([]).feed("anything") == "anything"


def test_stop_checker_property_every_chunking():
    rng = random.Random(2)
    for _ in range(500):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
        expected = text[: min(hits)[1]] if hits else text  # the first stop string to be completed
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        checker = StopChecker(stops)
        out = "".join(checker.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])) + checker.finish()
        assert (out, checker.is_hit) == (expected, bool(hits)), (text, stops, cuts)


# --- CompletionChoiceStream ----------------------------------------------------------------------


def test_stop_string_across_token_boundary(tok):
    ids = tok.encode("Hello world again and again")
    assert [tok.decode([i]) for i in ids[:3]] == ["Hello", " world", " again"]
    stream = CompletionChoiceStream(tok, stop=["lo wo"])
    assert stream.feed(ids[:1]) == "Hel"  # "lo" may start the stop string
    assert stream.feed(ids[1:]) == "" and stream.is_stopped
    assert stream.num_tokens == 2  # tokens after the one completing the stop string are not consumed
    assert stream.finish("length") == "" and stream.finish_reason == "stop"
    assert stream.text == "Hel"


@pytest.mark.parametrize("stop", ["🙂", "テキ", "o 日本", "𝔦𝔠", "Ωμ", "عربى"])
def test_stop_string_in_multibyte_text_for_random_chunkings(tok, stop):
    ids = tok.encode(MULTILINGUAL)
    rng = random.Random(stop)
    for _ in range(30):
        stream = CompletionChoiceStream(tok, stop=[stop])
        out = "".join(stream.feed(chunk) for chunk in random_chunks(ids, rng))
        out += stream.finish("length")
        assert out == stream.text == MULTILINGUAL[: MULTILINGUAL.find(stop)]
        assert stream.finish_reason == "stop"


def test_eos_and_stop_token_ids_end_the_text_unseen(tok):
    ids = tok.encode("Hi 🙂")
    stream = CompletionChoiceStream(tok)
    assert stream.feed(ids) + stream.feed([tok.eos_id]) + stream.finish("stop") == "Hi 🙂"
    assert (stream.num_tokens, stream.finish_reason) == (len(ids) + 1, "stop")
    stop_id = tok.encode(" again")[0]
    stream = CompletionChoiceStream(tok, stop_token_ids=[stop_id])
    assert stream.feed(ids + [stop_id]) + stream.finish("stop") == "Hi 🙂"
    stream = CompletionChoiceStream(tok)
    stream.feed(ids)
    stream.finish("length")
    assert stream.finish_reason == "length"
    with pytest.raises(RuntimeError):
        stream.feed(ids)


# --- ChatChoiceStream ----------------------------------------------------------------------------


def run_chat(tok, thinking: bool, ids: list[int], chunks: list[list[int]], **kwargs) -> tuple[ChatChoiceStream, list[dict]]:
    stream = ChatChoiceStream(tok, thinking=thinking, **kwargs)
    deltas = [d for chunk in chunks for d in stream.feed(chunk)]
    deltas += stream.finish("stop")
    return stream, deltas


def assemble(deltas: list[dict]) -> tuple[str, str, list[dict]]:
    """The deltas joined: a call opens with index, id, type and name (arguments ""), then argument fragments."""
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(calls) and c["function"]["arguments"] == "", c
                calls.append(json.loads(json.dumps(c)))
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}, c
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return reasoning, content, calls


@pytest.mark.parametrize(("thinking", "text"), CHAT_TEXTS)
def test_chat_deltas_reassemble_to_the_whole_parse(tok, thinking, text):
    ids = tok.encode(text) + [tok.eos_id]
    assert tok.decode(ids[:-1]) == text
    expected = parse_completion(text, thinking, TOOLS, id_salt="req/0")
    want_calls = [{"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for k, c in enumerate(expected.tool_calls)]
    rng = random.Random(text)
    chunkings = [[ids], [[i] for i in ids]] + [random_chunks(ids, rng) for _ in range(40)]
    for chunks in chunkings:
        stream, deltas = run_chat(tok, thinking, ids, chunks, tools=TOOLS, id_salt="req/0")
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas[1:]), deltas  # one kind, non-empty
        reasoning, content, calls = assemble(deltas)
        assert reasoning == (expected.reasoning_content or "") and content == expected.content
        assert calls == want_calls
        message = stream.message()
        assert message.get("reasoning_content") == expected.reasoning_content
        assert message["content"] == (expected.content if expected.content or not calls else None)
        assert [{"index": k, **c} for k, c in enumerate(message.get("tool_calls", []))] == want_calls
        assert stream.finish_reason == ("tool_calls" if calls else "stop")
        assert stream.num_tokens == len(ids)
    for d in deltas:
        ChatCompletionChunk.model_validate(chat_chunk("c", 1, "m", [chat_stream_choice(0, d)]))


def test_realistic_tool_call_arguments(tok):
    _, deltas = run_chat(tok, True, [], [tok.encode(CHAT_TEXTS[0][1]) + [tok.eos_id]], tools=TOOLS)
    calls = assemble(deltas)[2]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"location": "北京", "days": 3}), ("get_time", {"tz": "Asia/Shanghai"})]
    assert len({c["id"] for c in calls}) == 2


def test_reasoning_tokens_run_through_think_end(tok):
    text = "Let me think 🤔 about it.</think>The answer is 42."
    ids = tok.encode(text) + [tok.eos_id]
    expected = ids.index(THINK_END_ID) + 1
    rng = random.Random(3)
    for chunks in [[[i] for i in ids], [ids], *(random_chunks(ids, rng) for _ in range(10))]:
        stream, _ = run_chat(tok, True, ids, chunks)
        assert (stream.num_reasoning_tokens, stream.num_tokens) == (expected, len(ids))
    stream, _ = run_chat(tok, False, ids, [ids])
    assert stream.num_reasoning_tokens == 0
    never = tok.encode("thinking forever") + [tok.eos_id]
    stream, _ = run_chat(tok, True, never, [never])
    assert stream.num_reasoning_tokens == stream.num_tokens == len(never)


def test_tool_choice_none_keeps_dsml_as_content(tok):
    text = "Hmm.</think>Here:" + CALLS
    ids = tok.encode(text) + [tok.eos_id]
    stream, deltas = run_chat(tok, True, ids, [[i] for i in ids], parse_tool_calls=False)
    assert assemble(deltas) == ("Hmm.", "Here:" + CALLS, [])
    assert stream.message() == {"role": "assistant", "content": "Here:" + CALLS, "reasoning_content": "Hmm."}
    assert stream.finish_reason == "stop"


@pytest.mark.parametrize("parse_tool_calls", [True, False])
def test_think_end_written_in_ordinary_tokens(tok, parse_tool_calls):
    """`</think>` spelled with ordinary tokens ("</", "thi", "nk>") still ends the reasoning."""
    ids = tok.encode("Hmm 🤔.") + tok.encode("</thi") + tok.encode("nk>Here 🙂") + [tok.eos_id]
    assert THINK_END_ID not in ids and tok.decode(ids[:-1]) == "Hmm 🤔.</think>Here 🙂"
    for chunks in ([[i] for i in ids], [ids]):
        stream, deltas = run_chat(tok, True, ids, chunks, parse_tool_calls=parse_tool_calls)
        assert assemble(deltas) == ("Hmm 🤔.", "Here 🙂", [])
        # through ">", the token that completes "</think>" ("nk>" is two tokens)
        assert stream.num_reasoning_tokens == len(tok.encode("Hmm 🤔.") + tok.encode("</thi") + tok.encode("nk>"))


def test_chat_stop_string_cuts_content_and_later_calls(tok):
    text = "Reason.</think>The answer is 42. END then" + CALLS
    ids = tok.encode(text) + [tok.eos_id]
    rng = random.Random(4)
    for chunks in [[[i] for i in ids], *(random_chunks(ids, rng) for _ in range(10))]:
        stream = ChatChoiceStream(tok, thinking=True, tools=TOOLS, stop=[" END"])
        deltas = []
        for chunk in chunks:
            deltas += stream.feed(chunk)
            if stream.is_stopped:
                break  # where the ingress aborts the engine request
        deltas += stream.finish(None)
        assert assemble(deltas) == ("Reason.", "The answer is 42.", [])
        assert stream.finish_reason == "stop" and stream.num_tokens < len(ids)
    stream = ChatChoiceStream(tok, thinking=True, stop=["ason"])
    stream.feed(ids)
    assert assemble(stream.finish(None)) == ("", "", []) and stream.message()["reasoning_content"] == "Re"


def test_chat_finish_reasons_and_misuse(tok):
    ids = tok.encode("Hi" + CALLS)
    stream = ChatChoiceStream(tok, thinking=False, tools=TOOLS)
    stream.feed(ids)
    assert stream.finish("length") == []
    assert stream.finish_reason == "length"  # a call was made but the output was cut: length wins
    with pytest.raises(RuntimeError):
        stream.feed([1])
    with pytest.raises(RuntimeError):
        stream.finish("stop")
    with pytest.raises(RuntimeError):
        ChatChoiceStream(tok, thinking=False).message()
    empty = ChatChoiceStream(tok, thinking=True)
    assert empty.finish("stop") == [{"role": "assistant", "content": ""}]
    assert empty.message() == {"role": "assistant", "content": "", "reasoning_content": ""}


def test_sse_event():
    assert sse_event({"a": "é\n"}) == 'data: {"a":"é\\n"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


# --- the parser samples through the token pipeline; special tokens -------------------------------------------


def _samples():
    from tests.chat.test_parse import SAMPLES, TOOLS as SAMPLE_TOOLS

    return SAMPLES, SAMPLE_TOOLS


@pytest.mark.parametrize("index", range(len(_samples()[0])), ids=[s[0] for s in _samples()[0]])
def test_every_token_split_of_the_parser_samples_streams_no_tag_text(tok, index):
    """The model's output as token ids, cut at every token boundary (two chunks) and one token at a time: no
    reasoning, content or argument delta holds DSML or think-tag text, and each call's argument fragments join to
    the non-streamed message's arguments."""
    samples, tools = _samples()
    _, thinking, text, _ = samples[index]
    ids = tok.encode(text) + [tok.eos_id]
    whole, _ = run_chat(tok, thinking, ids, [ids], tools=tools, id_salt="r/0")
    want = whole.message()
    for chunks in [[[i] for i in ids]] + [[ids[:cut], ids[cut:]] for cut in range(1, len(ids))]:
        stream, deltas = run_chat(tok, thinking, ids, chunks, tools=tools, id_salt="r/0")
        for d in deltas:
            pieces = [d.get("reasoning_content", ""), d.get("content") or ""]
            pieces += [c["function"].get("arguments", "") + c["function"].get("name", "") for c in d.get("tool_calls", [])]
            assert not any(tag in p for p in pieces for tag in ("｜DSML｜", "<think>", "</think>", syntax.EOS)), d
        reasoning, content, calls = assemble(deltas)
        assert stream.message() == want
        assert [c["function"] for c in calls] == [c["function"] for c in want.get("tool_calls", [])]
        assert content == (want["content"] or "") and reasoning == (want.get("reasoning_content") or "")


def _tags_in_values():
    from tests.chat.test_parse import TAGS_IN_VALUES

    return TAGS_IN_VALUES


@pytest.mark.parametrize("index", range(len(_tags_in_values())), ids=[s[0] for s in _tags_in_values()])
def test_every_token_split_of_tag_text_inside_values_streams_as_the_whole(tok, index):
    """Argument values that hold tag text (tests/chat/test_parse.py: TAGS_IN_VALUES), cut at every token boundary and
    one token at a time: the deltas join to the non-streamed message, which reads the tags as the parser does."""
    _, thinking, text, expected = _tags_in_values()[index]
    tools = _samples()[1]
    ids = tok.encode(text) + [tok.eos_id]
    whole, _ = run_chat(tok, thinking, ids, [ids], tools=tools, id_salt="r/0")
    want = whole.message()
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]] == expected[2]
    for chunks in [[[i] for i in ids]] + [[ids[:cut], ids[cut:]] for cut in range(1, len(ids))]:
        stream, deltas = run_chat(tok, thinking, ids, chunks, tools=tools, id_salt="r/0")
        reasoning, content, calls = assemble(deltas)
        assert stream.message() == want
        assert [c["function"] for c in calls] == [c["function"] for c in want["tool_calls"]]
        assert content == (want["content"] or "") and reasoning == (want.get("reasoning_content") or "")


def test_skip_special_tokens(tok):
    """Tokens flagged special (a placeholder, BOS) are not text by default and are with skip_special_tokens false;
    V4.1's chat tags are added tokens but not special, so they stay text either way."""
    placeholder = tok.token_to_id("<｜place▁holder▁no▁111｜>")
    ids = tok.encode("A") + [placeholder, tok.bos_id] + tok.encode("B")
    shown = CompletionChoiceStream(tok, skip_special_tokens=False)
    assert shown.feed(ids) + shown.finish("stop") == "A<｜place▁holder▁no▁111｜><｜begin▁of▁sentence｜>B"
    hidden = CompletionChoiceStream(tok)
    assert hidden.feed(ids) + hidden.finish("stop") == "AB" and hidden.num_tokens == len(ids)
    chat = ChatChoiceStream(tok, thinking=True)
    chat.feed(tok.encode("r") + [placeholder, THINK_END_ID, placeholder] + tok.encode("c"))
    chat.finish("stop")
    assert (chat.message()["reasoning_content"], chat.message()["content"]) == ("r", "c")
    two_tags = CompletionChoiceStream(tok)  # no space between added tokens (vLLM's fast detokenizer: none either)
    assert two_tags.feed([THINK_END_ID, THINK_END_ID]) + two_tags.finish("stop") == "</think></think>"
