"""The chat endpoint's conversation and tools, as OpenAI sends them: messages (text parts,
assistant `tool_calls`, `tool` results), function tools and `tool_choice`.

A tool's parameter schema is checked against the JSON Schema metaschema here, so a malformed
one is a 400 naming it before any worker compiles it. `tool_choice: required` and a named
function become a JSON-schema constraint (`tool_constraint`), as vLLM builds them: the answer is
a JSON array of `{"name", "parameters"}` calls, or the named function's arguments.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from prefixserve.cluster.api_schema import RequestModel

MAX_TOOLS = 128  # OpenAI's bound
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
MAX_ID_CHARS = 256  # a tool call's id
# OpenAI's function names (letters, digits, `_`, `-`), and `.` as MCP tools use it.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ToolMode = Literal["none", "auto", "required", "named"]


class ContentPart(RequestModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        if self.text is None:  # OpenAI's and vLLM's text part requires it
            raise ValueError("a text content part needs its `text`")
        return self


def _check_name(name: str) -> str:
    if not FUNCTION_NAME.fullmatch(name):
        raise ValueError("a function name is 1 to 64 letters, digits, `_`, `-` or `.`")
    return name


FunctionName = Annotated[str, AfterValidator(_check_name)]


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: str  # JSON text of an object, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("arguments must be a JSON object, as text") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object, as text")
        return value


class ToolCall(RequestModel):
    """A call an earlier assistant turn made."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):  # report the part's own error, not the union's
            return [ContentPart.model_validate(part, strict=True) for part in value]
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("content must be a string or a list of text parts") from None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant turn with tool_calls "
                             "may omit it)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template reads it (transformers' shape): a developer turn is a
        system turn, a call's arguments are an object, as templates write them, and no content
        is empty text (as vLLM gives it: templates without tools still render the turn)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {
                    "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def remote_ref(schema: Any) -> str | None:
    """The first `$ref` of a JSON schema (an object, or its text) that points outside it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:  # not JSON: the compile names the error
            return None
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as exc:
            where = "/".join(map(str, exc.path)) or "the top level"
            raise ValueError(f"not a valid JSON schema at {where}: {exc.message}") from None
        if value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a schema of type object")
        return value


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template reads them (transformers' JSON shape, unset fields out)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def check_tools(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    return tools


def check_tool_choice(value: Any, handler: ValidatorFunctionWrapHandler,
                      info: ValidationInfo) -> Any:
    """One message for every wrong shape (the union's would be four); a choice other than
    `none` needs tools, a named one among them."""
    try:
        choice = handler(value)
    except ValidationError:
        raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": ...}}') from None
    names = [t.function.name for t in info.data.get("tools") or []]
    if choice != "none" and not names:
        raise ValueError('needs tools (only "none" goes without)')
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"names {choice.function.name!r}, which is not among the tools")
    return choice


def tool_mode(tools: list[ToolDefinition] | None, choice: ToolChoice | None) -> ToolMode:
    """How the answer is read: no tools (or `none`): text; tools with no tool_choice: `auto`,
    as OpenAI and vLLM default."""
    if not tools or choice == "none":
        return "none"
    if isinstance(choice, NamedToolChoice):
        return "named"
    return choice or "auto"


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object"}


def tool_constraint(tools: list[ToolDefinition], choice: ToolChoice | None,
                    parallel: bool) -> dict[str, Any] | None:
    """The JSON schema `required` or a named function holds the answer to (None otherwise):
    a JSON array of calls, one object per call with the tool's name and its parameters, at
    most one without `parallel_tool_calls`; or the named function's arguments."""
    mode = tool_mode(tools, choice)
    if mode == "named":
        assert isinstance(choice, NamedToolChoice)
        named = [t.function for t in tools if t.function.name == choice.function.name]
        return _parameters(named[0]) if named else None  # not among them: check_tools says so
    if mode != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t.function)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
