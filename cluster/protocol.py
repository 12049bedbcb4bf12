"""The OpenAI API subset prefixserve accepts and returns, as pydantic v2 models.

Requests are validated strictly (no string-to-number coercion, NaN/inf rejected, bounded lists)
so bad input becomes a clear 400 instead of a surprise deep in the engine. Unknown fields are
ignored: the official `openai` client and other SDKs send fields we do not act on. Fields of
OpenAI's and vLLM's requests that would silently change the answer if ignored (`REFUSED`, and
`best_of` other than `n`) are rejected when set to anything but their neutral value. The chat
conversation and its tools are in cluster/chat_protocol.py.

A structured output is asked for as OpenAI does (`response_format` of type `json_object` or
`json_schema`), as vLLM does (`structured_outputs`: `json`, `regex`, `choice` or `grammar`), or
with vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; at most one
per request; `tool_choice: required` or a named function is one too. The worker compiles it (a
constraint that does not compile is a 400 there).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import (
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from prefixserve.cluster.api_schema import RequestModel
from prefixserve.cluster.chat_protocol import (
    MAX_TOOLS,
    ChatMessage,
    ToolChoice,
    ToolDefinition,
    ToolMode,
    check_tool_choice,
    check_tools,
    remote_ref,
    tool_constraint,
    tool_mode,
)
from prefixserve.router.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STRUCTURED_CHARS,
    SamplingParams,
    StructuredOutput,
)

# The sampling settings' bounds are the request protocol's (router/sampling_params.py): the
# engine validates against the same numbers. These bound what only the API has.
MAX_PROMPTS = 32  # prompts per completions request (batch)
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request: each costs the worker on every step
# Digits in a token id written as text (logit_bias keys): every id below 2**31 fits, and a
# longer key is refused before int() reads it (Python's int() refuses past 4,300 digits).
MAX_TOKEN_ID_DIGITS = 10

# Fields of OpenAI's and vLLM's requests that would change the answer and that prefixserve does
# not implement, each with its neutral values (what it means when absent): any other value is a
# 400 naming the field, never silently ignored.
REFUSED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,), "bad_words": (None, []), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "logits_processors": (None, []), "priority": (None, 0),
    "guided_whitespace_pattern": (None,), "return_tokens_as_token_ids": (None, False),
    "vllm_xargs": (None, {})}
COMPLETION_REFUSED = {**REFUSED, "echo": (None, False), "suffix": (None, "")}
CHAT_REFUSED = {**REFUSED, "echo": (None, False), "continue_final_message": (None, False),
                "chat_template": (None,), "documents": (None,), "functions": (None,),
                "function_call": (None,), "audio": (None,), "modalities": (None, ["text"])}


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


Constraint = str | dict[str, Any]  # a JSON schema as an object, or any constraint's text


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: Constraint | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = None
    structural_tag: Constraint | None = None  # xgrammar's structural tag, or vLLM's first shape

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [n for n, _ in STRUCTURED_FIELDS if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, structural_tag")
        return self


# (field, kind) of each constraint `structured_outputs` takes
STRUCTURED_FIELDS = (("json_", "json"), ("regex", "regex"), ("choice", "choice"),
                     ("grammar", "grammar"), ("structural_tag", "structural_tag"))


def _spec(value: Constraint | list[str], field: str, kind: str = "json") -> str:
    """A constraint's text, bounded; a schema's `$ref`s local (xgrammar reads others as any)."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_STRUCTURED_CHARS:
        raise ValueError(f"{field} is longer than {MAX_STRUCTURED_CHARS} characters")
    if kind in ("json", "structural_tag") and (ref := remote_ref(value)) is not None:
        raise ValueError(f'{field}: only local $refs ("#...") are supported, got {ref[:80]!r}')
    return text


class _SamplingRequest(RequestModel):
    """Fields both endpoints share."""

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = REFUSED

    model: str | None = None  # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM accepts both)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM extension; 1: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM extension; 0: off
    min_tokens: int = Field(0, ge=0)  # vLLM extension: EOS and stop tokens held back until then
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM extension
    guided_json: Constraint | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = None
    best_of: int | None = None  # OpenAI's completions; vLLM's chat too: only `n` is served
    allowed_token_ids: list[int] | None = Field(None, min_length=1,  # vLLM's output options
                                                max_length=MAX_ALLOWED_TOKEN_IDS)
    include_stop_str_in_output: bool = False  # the stop string or token ends the text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no effect: a fast tokenizer decodes without
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the prompt's last k tokens

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            errors = [InitErrorDetails(type=PydanticCustomError(
                "unsupported", "{field} is not supported", {"field": name}),
                loc=(name,), input=data[name])
                for name, neutral in cls.REFUSED.items()
                if name in data and data[name] not in neutral]
            if errors:
                raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed")
        for s in stops:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_LEN:
                raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _check_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"keys must be token ids (decimal integers), got "
                                 f"{token[:MAX_TOKEN_ID_DIGITS + 2]!r}")
            if len(token) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"keys must be token ids of at most {MAX_TOKEN_ID_DIGITS} "
                                 f"digits, got one of {len(token):,}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}")
        return value

    @field_validator("response_format")
    @classmethod
    def _check_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = None if value is None else value.get("type")
        if value is None or kind in ("text", "json_object", "structural_tag"):
            return value
        if kind != "json_schema":
            raise ValueError(f"type must be text, json_object, json_schema or structural_tag, "
                             f"got {kind!r}")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise ValueError("json_schema must be an object whose `schema` is a JSON schema")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingRequest:
        self.structured_output()  # at most one, each within its bound
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The request's constraint, if any (raises ValueError for two, or one too long)."""
        found: list[StructuredOutput] = []
        fmt = self.response_format or {}
        if fmt.get("type") == "json_object":
            found.append(StructuredOutput("json", "", "response_format"))
        elif fmt.get("type") == "json_schema":
            schema = fmt["json_schema"].get("schema", {})
            found.append(StructuredOutput("json", _spec(schema, "response_format"),
                                          "response_format"))
        elif fmt.get("type") == "structural_tag":  # vLLM's: the tag is the format itself
            found.append(StructuredOutput("structural_tag", _spec(fmt, "response_format"),
                                          "response_format"))
        so = self.structured_outputs
        if so is not None:
            name, kind = next((n, k) for n, k in STRUCTURED_FIELDS if getattr(so, n) is not None)
            found.append(StructuredOutput(kind, _spec(getattr(so, name), "structured_outputs",
                                                      kind), f"structured_outputs.{kind}"))
        if (tools := self.tool_constraint()) is not None:
            found.append(tools)
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append(StructuredOutput(kind, _spec(value, f"guided_{kind}", kind),
                                              f"guided_{kind}"))
        if len(found) > 1:
            raise ValueError(f"give one structured output, not {len(found)} "
                             f"({', '.join(f.field for f in found)})")
        return found[0] if found else None

    def tool_constraint(self) -> StructuredOutput | None:
        """The constraint `tool_choice` sets (chat only)."""
        return None

    @model_validator(mode="after")
    def _check_counts(self) -> _SamplingRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n when given)")
        limit = self.max_output_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed the maximum "
                             f"number of tokens to generate ({limit})")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        """The request's cap on generated tokens per choice; None: the rest of the context."""
        raise NotImplementedError

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` keyed by token id, as `SamplingParams` takes it."""
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's sampling settings (max_tokens and logprobs: as each endpoint reads
        them)."""
        fields: dict[str, Any] = {"n": self.n, "ignore_eos": self.ignore_eos,
                                  "max_tokens": max_tokens, "logprobs": logprobs}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.top_k is not None:
            fields["top_k"] = max(self.top_k, 0)
        if self.seed is not None:
            fields["seed"] = self.seed
        if self.stop_token_ids:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.min_tokens:
            fields["min_tokens"] = self.min_tokens
        if self.logit_bias:
            fields["logit_bias"] = self.logit_bias_ids
        if self.allowed_token_ids:
            fields["allowed_token_ids"] = tuple(self.allowed_token_ids)
        fields["structured"] = self.structured_output()
        return SamplingParams(**fields)


PromptInput = str | list[int]


class CompletionRequest(_SamplingRequest):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_REFUSED
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS before a text prompt

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of token ids, a list of strings "
                "or a list of token-id lists"
            ) from None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(len(p) == 0 for p in prompt):
                raise ValueError("prompts must not be empty")
        elif len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[PromptInput]:
        """The prompts as a batch: each one text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class ChatCompletionRequest(_SamplingRequest):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_REFUSED
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM extension, for chat templates
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: template variables
    add_special_tokens: bool = False  # vLLM: the template writes BOS itself

    _tools = field_validator("tools")(check_tools)
    _tool_choice = field_validator("tool_choice", mode="wrap")(check_tool_choice)

    @property
    def tool_mode(self) -> ToolMode:
        return tool_mode(self.tools, self.tool_choice)

    def tool_constraint(self) -> StructuredOutput | None:
        schema = tool_constraint(self.tools or [], self.tool_choice, self.parallel_tool_calls)
        if schema is None:
            return None
        return StructuredOutput("json", _spec(schema, "tools"), "tools")

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None when off, else the number of alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None
