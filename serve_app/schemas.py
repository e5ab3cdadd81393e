"""The request bodies of /v1/chat/completions and /v1/completions as pydantic models, for /openapi.json only.

They describe what `serve_app/protocol.py` (and `engine.chat.render_chat`, which checks the messages)
accepts: fields, types, ranges, enums; a null counts as absent; unknown fields are allowed (and ignored).
They validate nothing: the handlers take the raw body and protocol.py stays the validator, with its
messages naming the field. The routes attach the schemas through `openapi_extra` (`request_body`).

What JSON Schema cannot say, and protocol.py alone checks: that a response_format schema or a tool's parameters can
be enforced (llguidance compiles them), that a JSON response_format does not come with tool_choice required or
named, tool_choice other than "none" needs tools, a named
tool_choice must name one of them, tool names are unique, top_logprobs needs logprobs, stream_options needs
stream, a tool message answers an earlier call's id, completion token ids are below the vocabulary size, and
the prompt fits the context window and --max-prompt-chars. JSON Schema also counts 2.0 as an integer; Python's
json does not, so protocol.py answers 400 to `"n": 2.0`. A developer message's text parts are each non-empty
here (protocol.py needs only their join to be).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from serve_app.protocol import (DEFAULT_MAX_MESSAGES, DEFAULT_MAX_N, MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS,
                                MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, REASONING_EFFORTS)

REF = "#/components/schemas/{model}"
NonEmpty = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown keys are accepted and ignored


# ---- messages (engine/chat/render.py) -----------------------------------------------------------------------
class TextPart(_Open):
    type: Literal["text"]
    text: str


class NonEmptyTextPart(_Open):
    type: Literal["text"]
    text: NonEmpty


Content = Union[str, list[TextPart]]


class ToolCallFunction(_Open):
    name: NonEmpty
    arguments: Union[str, dict[str, Any]] = Field(description="JSON text or an object")


class ToolCall(_Open):
    type: Literal["function"] = "function"
    id: str = ""
    function: ToolCallFunction


class SystemMessage(_Open):
    role: Literal["system", "latest_reminder"]
    content: Content
    name: str | None = None


class DeveloperMessage(_Open):
    role: Literal["developer"]
    content: Union[NonEmpty, Annotated[list[NonEmptyTextPart], Field(min_length=1)]]
    name: str | None = None


class UserMessage(_Open):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="an alias of reasoning_content")
    tool_calls: list[ToolCall] | None = None
    name: str | None = None


class ToolMessage(_Open):
    role: Literal["tool"]
    tool_call_id: str = Field(description="the id of a call of an earlier assistant message")
    content: Content
    name: str | None = None


Message = Annotated[Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
                    Field(discriminator="role")]


# ---- tools -----------------------------------------------------------------------------------------------
class FunctionDefinition(_Open):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")
    strict: bool | None = Field(None, description="true: under tool_choice auto this tool's arguments are "
                                                  "constrained to parameters (under required or named every "
                                                  "tool's are, whatever it says)")


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: ToolChoiceFunction


# ---- the bodies ------------------------------------------------------------------------------------------
class StreamOptions(_Open):
    include_usage: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema; null: any JSON object")
    strict: bool | None = Field(None, description="enforced either way")
    description: str | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class _CommonBody(_Open):
    model: NonEmpty = Field(description="a served model's name (see /v1/models)")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="default 1; 0 is greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="default 1")
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="0 or -1: off")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=DEFAULT_MAX_N)] | None = Field(None, description="at most the server's --max-n")
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream true")
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = Field(None, description="only 0")
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = Field(None, description="only 0")
    repetition_penalty: Annotated[float, Field(ge=1, le=1)] | None = Field(None, description="only 1")
    logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = Field(None, description="only {}")
    skip_special_tokens: bool | None = Field(None, description="default true: tokens flagged special are not text")
    spaces_between_special_tokens: bool | None = Field(None, description="default true (vLLM's; no effect here)")
    response_format: Union[ResponseFormat, JsonObjectFormat, JsonSchemaFormat, None] = Field(
        None, description="json_object / json_schema: the output is constrained to JSON (the schema enforced)")


class ChatCompletionBody(_CommonBody):
    messages: Annotated[list[Message], Field(min_length=1, max_length=DEFAULT_MAX_MESSAGES)] = Field(
        description="at most the server's --max-messages")
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    reasoning_effort: Union[Literal[REASONING_EFFORTS], Annotated[int, Field(ge=1, le=100)],
                            Annotated[str, Field(pattern=r"^0*([1-9][0-9]?|100)$")], None] = Field(
        None, description="none (chat mode); minimal/low (budget 50), medium/high/xhigh (75), max (100); or a budget "
                          "1-100 (also as a decimal string); null: high")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="default: the rest of the window")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="wins over max_tokens")
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = Field(
        None, description="only with logprobs true")


class CompletionBody(_CommonBody):
    prompt: Union[NonEmpty, Annotated[list[TokenId], Field(min_length=1)]] = Field(
        description="one prompt: text or token ids (no batches)")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="default 16")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: Literal[False] | None = None
    suffix: None = Field(None, description="not supported")
    best_of: Literal[1] | None = None


BODY_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionBody, CompletionBody)


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON request body is `model` (defined in the document's components)."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def body_schemas(*, max_n: int, model_names: Sequence[str], max_messages: int = DEFAULT_MAX_MESSAGES,
                 max_output_tokens: int | None = None) -> dict[str, dict]:
    """The JSON schemas of BODY_MODELS and everything they use, by name, for a deployment: n capped at its
    max_n, messages at its max_messages, max_tokens at its max_output_tokens (when set), and model one of
    the names it serves (any other is a 404)."""
    _, defs = models_json_schema([(m, "validation") for m in BODY_MODELS], ref_template=REF)
    schemas = defs["$defs"]
    for model in BODY_MODELS:
        properties = schemas[model.__name__]["properties"]
        _integer(properties["n"])["maximum"] = max_n
        properties["model"]["enum"] = list(model_names)
        for name in ("max_tokens", "max_completion_tokens"):
            if name in properties and max_output_tokens is not None:
                _integer(properties[name])["maximum"] = max_output_tokens
    schemas["ChatCompletionBody"]["properties"]["messages"]["maxItems"] = max_messages
    return schemas


def _integer(prop: dict) -> dict:
    [integer] = [s for s in prop["anyOf"] if s.get("type") == "integer"]
    return integer


def openapi_document(app: FastAPI, *, max_n: int, model_names: Sequence[str], max_messages: int = DEFAULT_MAX_MESSAGES,
                     max_output_tokens: int | None = None) -> dict:
    """FastAPI's OpenAPI document of app's routes, with the request-body schemas their routes reference."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(
        body_schemas(max_n=max_n, model_names=model_names, max_messages=max_messages,
                     max_output_tokens=max_output_tokens))
    return doc
