"""render_chat against hand-written prompts.

Expected strings are written out literally from the spec (section 7) and from the V4.1 reference
encoder's golden outputs (vLLM `tests/tokenizers_/fixtures/deepseek_v41/test_output_{1,2}.txt`, whose
inputs are `fixtures/deepseek_v4/test_input_{1,2}.json`), not built with the code under test.
"""

from __future__ import annotations

import copy

import pytest

from engine.chat import ChatFormatError, is_thinking, render_chat

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


def effort(n: int) -> str:
    return (
        f"<｜System｜>Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n"
    )


HI = [{"role": "user", "content": "Hi"}]


# --- the spec's examples -------------------------------------------------------------------------


def test_spec_thinking_high_single_user_turn():
    assert render_chat(HI, reasoning_effort="high") == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>"
    )


def test_spec_chat_mode():
    assert render_chat(HI, reasoning_effort="none") == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    )


def test_spec_system_message_with_effort_30():
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    assert render_chat(messages, reasoning_effort=30) == (
        BOS + effort(30) + "Be brief.<｜User｜>Hi<｜Assistant｜><think>"
    )


def test_chat_mode_system_message_has_no_effort_line():
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    assert render_chat(messages, reasoning_effort="none") == (
        BOS + "<｜System｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    ("value", "budget"),
    [(None, 75), ("minimal", 50), ("low", 50), ("medium", 75), ("high", 75), ("xhigh", 75), ("max", 100), (1, 1),
     (42, 42), (100, 100)],
)
def test_reasoning_effort_values(value, budget):
    assert render_chat(HI, reasoning_effort=value) == BOS + effort(budget) + "<｜User｜>Hi<｜Assistant｜><think>"
    assert is_thinking(value)


def test_is_thinking_none_is_chat_mode():
    assert not is_thinking("none")


# --- multi-turn ----------------------------------------------------------------------------------

# vLLM fixture deepseek_v4/test_input_2.json (it spells the reasoning field `reasoning`).
FIXTURE_2 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello"},
    {
        "role": "assistant",
        "reasoning": "The user said hello, I should greet back.",
        "content": "Hi there! How can I help you?",
    },
    {"role": "user", "content": "What is the capital of France?"},
    {
        "role": "assistant",
        "reasoning": "The user asks about the capital of France. It is Paris.",
        "content": "The capital of France is Paris.",
    },
]


def test_reference_fixture_2_drops_reasoning_before_last_user():
    # deepseek_v41/test_output_2.txt, plus the generation header the reference adds after a final
    # assistant turn.
    assert render_chat(FIXTURE_2) == (
        BOS + effort(75) + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>"
        "Hi there! How can I help you?" + EOS + "<｜User｜>What is the capital of France?"
        "<｜Assistant｜><think>The user asks about the capital of France. It is Paris.</think>"
        "The capital of France is Paris." + EOS + "<｜Assistant｜><think>"
    )


def test_multi_turn_generation_prompt_drops_earlier_reasoning():
    messages = FIXTURE_2[:4]
    assert render_chat(messages) == (
        BOS + effort(75) + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>"
        "Hi there! How can I help you?" + EOS + "<｜User｜>What is the capital of France?"
        "<｜Assistant｜><think>"
    )


def test_multi_turn_keeps_reasoning_when_drop_thinking_is_false():
    assert render_chat(FIXTURE_2[:4], drop_thinking=False) == (
        BOS + effort(75) + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜><think>"
        "The user said hello, I should greet back.</think>Hi there! How can I help you?" + EOS
        + "<｜User｜>What is the capital of France?<｜Assistant｜><think>"
    )


def test_multi_turn_chat_mode_never_writes_reasoning():
    assert render_chat(FIXTURE_2[:4], reasoning_effort="none", drop_thinking=False) == (
        BOS + "<｜System｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>"
        "Hi there! How can I help you?" + EOS + "<｜User｜>What is the capital of France?"
        "<｜Assistant｜></think>"
    )


def test_render_does_not_mutate_messages():
    messages = copy.deepcopy(FIXTURE_2)
    render_chat(messages, tools=[{"type": "function", "function": {"name": "f"}}])
    assert messages == FIXTURE_2


# --- tools ---------------------------------------------------------------------------------------

# vLLM fixture deepseek_v4/test_input_1.json.
FIXTURE_1_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a specific location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "Temperature unit",
                    },
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web for information",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search query"},
                    "num_results": {"type": "integer", "description": "Number of results to return"},
                },
                "required": ["query"],
            },
        },
    },
]
FIXTURE_1_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {
        "role": "assistant",
        "reasoning": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
        "tool_calls": [
            {
                "id": "call_001",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'},
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_001",
        "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}',
    },
    {
        "role": "assistant",
        "reasoning": "Got the weather data. Let me format a nice response.",
        "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.",
    },
]

TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

FIXTURE_1_SCHEMAS = (
    '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": '
    '{"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, '
    '"unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, '
    '"required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", "parameters": {"type": '
    '"object", "properties": {"query": {"type": "string", "description": "Search query"}, '
    '"num_results": {"type": "integer", "description": "Number of results to return"}}, "required": '
    '["query"]}}'
)


def test_reference_fixture_1_tools_calls_and_results():
    # deepseek_v41/test_output_1.txt plus the final generation header. Tools keep all reasoning.
    expected = (
        BOS + effort(75) + "You are a helpful assistant.\n\n"
        + TOOLS_PROMPT.replace("{schemas}", FIXTURE_1_SCHEMAS)
        + "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the "
        "weather in Beijing. I should use the get_weather tool.</think>\n\n"
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="location" string="true">Beijing</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="unit" string="true">celsius</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>" + EOS
        + '<｜User｜><tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result>'
        "<｜Assistant｜><think>Got the weather data. Let me format a nice response.</think>The weather in "
        "Beijing is currently sunny with a temperature of 22°C and 45% humidity." + EOS
        + "<｜Assistant｜><think>"
    )
    assert render_chat(FIXTURE_1_MESSAGES, tools=FIXTURE_1_TOOLS) == expected


def test_tools_without_system_message_get_an_empty_one_at_index_0():
    tool = {"type": "function", "function": {"name": "now", "description": "Current time, ISO 8601"}}
    schemas = '{"name": "now", "description": "Current time, ISO 8601"}'
    assert render_chat(HI, tools=[tool]) == (
        BOS + effort(75) + "\n\n" + TOOLS_PROMPT.replace("{schemas}", schemas)
        + "<｜User｜>Hi<｜Assistant｜><think>"
    )
    assert render_chat(HI, tools=[tool], reasoning_effort="none") == (
        BOS + "<｜System｜>\n\n" + TOOLS_PROMPT.replace("{schemas}", schemas)
        + "<｜User｜>Hi<｜Assistant｜></think>"
    )


def test_tool_schema_keeps_non_ascii_and_key_order():
    tool = {"type": "function", "function": {"parameters": {}, "name": "天气", "description": "查询"}}
    prompt = render_chat(HI, tools=[tool])
    assert '\n\n{"parameters": {}, "name": "天气", "description": "查询"}\n\n' in prompt


def test_empty_tools_list_is_no_tools():
    assert render_chat(FIXTURE_2[:4], tools=[]) == render_chat(FIXTURE_2[:4])


def test_tool_call_values_string_and_json():
    call = {
        "id": "c1",
        "type": "function",
        "function": {
            "name": "f",
            "arguments": '{"s": "x y", "n": 3, "b": false, "l": [1, "é"], "o": {"k": null}}',
        },
    }
    messages = [*HI, {"role": "assistant", "content": "ok", "tool_calls": [call]}]
    assert render_chat(messages, reasoning_effort="none") == (
        BOS + "<｜User｜>Hi<｜Assistant｜></think>ok\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="s" string="true">x y</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="false">false</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="l" string="false">[1, "é"]</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="o" string="false">{"k": null}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS + "<｜Assistant｜></think>"
    )


def test_tool_call_arguments_as_object_double_encoded_or_not_an_object():
    def rendered_params(arguments):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        prompt = render_chat([*HI, {"role": "assistant", "tool_calls": [call]}], reasoning_effort="none")
        return prompt.split('<｜DSML｜ invoke name="f">\n')[1].split("\n</｜DSML｜ invoke>")[0]

    one = '<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>'
    assert rendered_params({"a": 1}) == one
    assert rendered_params('"{\\"a\\": 1}"') == one  # JSON text of JSON text
    assert rendered_params("[1, 2]") == (
        '<｜DSML｜ parameter name="arguments" string="true">[1, 2]</｜DSML｜ parameter>'
    )
    assert rendered_params("{}") == ""


def test_tool_results_merged_into_one_user_turn_in_call_order():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    messages = [
        {"role": "user", "content": "Do both."},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "result of g"},
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "result of f"}]},
        {"role": "user", "content": "Thanks, now summarise."},
    ]
    prompt = render_chat(messages, reasoning_effort="none")
    assert prompt.endswith(
        "</｜DSML｜ calls>" + EOS
        + "<｜User｜><tool_result>result of f</tool_result>\n\n<tool_result>result of g</tool_result>"
        "\n\nThanks, now summarise.<｜Assistant｜></think>"
    )


def test_consecutive_user_messages_form_one_turn():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(messages, reasoning_effort="none") == BOS + "<｜User｜>a\n\nb<｜Assistant｜></think>"


def test_agent_loop_without_tools_param_drops_reasoning_before_tool_results():
    # The merged tool-result turn is the last user turn, so the calling turn's reasoning goes.
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "think", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a", "content": "r"},
    ]
    block = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    assert render_chat(messages) == (
        BOS + effort(75) + "<｜User｜>q<｜Assistant｜></think>" + block + EOS
        + "<｜User｜><tool_result>r</tool_result><｜Assistant｜><think>"
    )
    assert render_chat(messages, drop_thinking=False) == (
        BOS + effort(75) + "<｜User｜>q<｜Assistant｜><think>think</think>" + block + EOS
        + "<｜User｜><tool_result>r</tool_result><｜Assistant｜><think>"
    )


# --- other roles ---------------------------------------------------------------------------------


def test_content_parts_joined_with_blank_line():
    messages = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    assert render_chat(messages, reasoning_effort="none") == (
        BOS + "<｜User｜>first\n\nsecond<｜Assistant｜></think>"
    )


def test_latest_reminder_follows_the_assistant_header():
    messages = [*HI, {"role": "latest_reminder", "content": "Today is Monday."}]
    assert render_chat(messages) == (
        BOS + effort(75) + "<｜User｜>Hi<｜Assistant｜><think><｜latest_reminder｜>Today is Monday."
    )


def test_latest_reminder_first():
    messages = [{"role": "latest_reminder", "content": "R"}, *HI]
    assert render_chat(messages) == BOS + effort(75) + "<｜latest_reminder｜>R<｜User｜>Hi<｜Assistant｜><think>"


def test_developer_renders_as_user_turn():
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, *HI]
    assert render_chat(messages, reasoning_effort="none") == (
        BOS + "<｜System｜>S<｜User｜>D<｜User｜>Hi<｜Assistant｜></think>"
    )
    assert render_chat(messages, drop_thinking=False) == (
        BOS + effort(75) + "S<｜User｜>D<｜User｜>Hi<｜Assistant｜><think>"
    )


def test_developer_before_last_user_is_dropped_in_thinking_mode():
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, *HI]
    assert render_chat(messages) == BOS + effort(75) + "S<｜User｜>Hi<｜Assistant｜><think>"


def test_developer_last_gets_the_header():
    messages = [*HI, {"role": "developer", "content": "D"}]
    assert render_chat(messages) == BOS + effort(75) + "<｜User｜>Hi<｜User｜>D<｜Assistant｜><think>"


def test_mid_conversation_system_message():
    messages = [{"role": "user", "content": "question"}, {"role": "system", "content": "answer briefly"}]
    assert render_chat(messages, reasoning_effort="none") == (
        BOS + "<｜User｜>question<｜System｜>answer briefly<｜Assistant｜></think>"
    )
    assert render_chat(messages) == (
        BOS + effort(75) + "<｜User｜>question<｜System｜>answer briefly<｜Assistant｜><think>"
    )


def test_system_only():
    assert render_chat([{"role": "system", "content": "S"}]) == BOS + effort(75) + "S<｜Assistant｜><think>"


# --- errors --------------------------------------------------------------------------------------


def call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"messages": []}, "messages: must not be empty"),
        ({"messages": "Hi"}, "messages: must be a list, got str"),
        ({"messages": ["Hi"]}, "messages[0]: must be an object"),
        ({"messages": [*HI, *HI, {"role": "foo", "content": "x"}]}, "messages[2].role: unknown role 'foo'"),
        ({"messages": [{"content": "x"}]}, "messages[0].role: unknown role None"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content: must be a string or a list"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content: must be a string or a list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text: must be a string",
        ),
        (
            {"messages": [{"role": "user", "content": ["a"]}]},
            "messages[0].content[0]: must be an object",
        ),
        (
            {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, *HI]},
            "messages[0].content[0].type: image_url parts are accepted in user messages only",
        ),
        ({"messages": [{"role": "developer", "content": ""}, *HI]}, "messages[0].content: a developer"),
        (
            {"messages": [*HI, {"role": "tool", "tool_call_id": "x", "content": "r"}]},
            "messages[1].tool_call_id: 'x' matches no earlier tool call",
        ),
        (
            {
                "messages": [
                    *HI,
                    {"role": "tool", "tool_call_id": "a", "content": "r"},
                    {"role": "assistant", "content": "", "tool_calls": [call("a")]},
                ]
            },
            "messages[1].tool_call_id: 'a' matches no earlier tool call",
        ),
        ({"messages": [*HI, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id: must be a string"),
        (
            {"messages": [*HI, {"role": "assistant", "reasoning_content": 1}]},
            "messages[1].reasoning_content: must be a string",
        ),
        (
            {"messages": [*HI, {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}]},
            "messages[1].tool_calls[0].function.name: must be a non-empty string",
        ),
        (
            {
                "messages": [
                    *HI,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": None}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments: must be a JSON string or an object",
        ),
        (
            {"messages": [*HI, {"role": "assistant", "tool_calls": "f()"}]},
            "messages[1].tool_calls: must be a list",
        ),
        ({"messages": HI, "tools": {"name": "f"}}, "tools: must be a list, got dict"),
        ({"messages": HI, "tools": [{"type": "function"}]}, "tools[0].function: must be an object"),
        (
            {"messages": HI, "tools": [{"type": "function", "function": {"name": ""}}]},
            "tools[0].function.name: must be a non-empty string",
        ),
        (
            {"messages": HI, "tools": [{"type": "code_interpreter", "function": {"name": "f"}}]},
            "tools[0].type: unsupported tool type 'code_interpreter'",
        ),
        (
            {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "x": {1, 2}}}]},
            "tools[0].function: not JSON-serialisable",
        ),
    ],
)
def test_invalid_input_names_the_field(kwargs, message):
    with pytest.raises(ChatFormatError) as info:
        render_chat(**kwargs)
    assert str(info.value).startswith(message), str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("value", "shown"),
    [(150, "150"), (0, "0"), (-1, "-1"), ("extreme", "'extreme'"), ("HIGH", "'HIGH'"), (True, "True"),
     (50.0, "50.0"), ([], "[]")],
)
def test_invalid_reasoning_effort(value, shown):
    expected = f"reasoning_effort: must be none/minimal/low/medium/high/xhigh/max or an integer 1-100, got {shown}"
    with pytest.raises(ChatFormatError, match="^" + expected.replace("[", r"\[").replace("]", r"\]") + "$"):
        render_chat(HI, reasoning_effort=value)
    with pytest.raises(ChatFormatError):
        is_thinking(value)
