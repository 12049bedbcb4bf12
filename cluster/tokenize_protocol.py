"""Bodies of vLLM's endpoints besides generation (`POST /tokenize`, `POST /detokenize`,
`GET /version`, `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`), in vLLM's shapes
so its clients and scripts work unchanged.

`/tokenize` takes vLLM's two forms in one model: a completion prompt (`prompt`) or a chat
(`messages`, rendered with the chat template first). Validation is as strict as the generation
requests' (cluster/protocol.py): no coercion, unknown fields ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from prefixserve.cluster.api_schema import RequestModel
from prefixserve.cluster.chat_protocol import MAX_TOOLS, ChatMessage, ToolDefinition


class TokenizeRequest(RequestModel):
    model: str | None = None  # None: the served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vLLM's defaults: true for a prompt, false for a chat (its template writes BOS itself)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)  # for the template
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either `prompt` (text) or `messages` (a chat), not both")
        return self

    @property
    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class LoadLoRARequest(RequestModel):
    """vLLM's `POST /v1/load_lora_adapter`: serve the adapter at `lora_path` as `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(RequestModel):
    """vLLM's `POST /v1/unload_lora_adapter`."""

    lora_name: str = Field(min_length=1, max_length=256)
