"""vLLM's /tokenize, /detokenize, /version and /v1/models/{id} on the ingress class itself (no
Ray: these routes never reach a worker). test_api.py checks them over real HTTP too."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from prefixserve.cluster.api import VERSION, OpenAIIngress
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.guard import GuardSettings
from prefixserve.cluster.ingress_config import IngressConfig
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

MAX_MODEL_LEN = 64
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def ingress() -> Any:
    """The undecorated class (Serve's ingress wrapper needs a running replica)."""
    cls = OpenAIIngress.func_or_class.__mro__[1]
    return cls(None, BUILTIN_MODEL_NAME, BUILTIN_MODEL_NAME, MAX_MODEL_LEN,
               GuardSettings.of(IngressConfig()))


def call(route: Any, body: dict[str, Any]) -> dict[str, Any]:
    raw = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return asyncio.run(route(Request({"type": "http", "method": "POST", "headers": []}, receive)))


def error(route: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as exc:
        call(route, body)
    return exc.value


def test_tokenize_prompt_and_detokenize(ingress: Any) -> None:
    tok = ingress.tokenizer
    out = call(ingress.tokenize, {"model": BUILTIN_MODEL_NAME, "prompt": "hello world"})
    ids = tok.encode("hello world")
    assert out == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                   "token_strs": None}
    plain = call(ingress.tokenize, {"prompt": "hello world", "add_special_tokens": False,
                                    "return_token_strs": True})
    assert plain["tokens"] == tok.encode("hello world", add_special_tokens=False)
    assert plain["token_strs"] == [tok.token_piece(i) for i in plain["tokens"]]
    back = call(ingress.detokenize, {"model": BUILTIN_MODEL_NAME, "tokens": out["tokens"]})
    assert back == {"prompt": tok.decode(ids, skip_special_tokens=False)}


def test_tokenize_chat_is_what_chat_completions_sends(ingress: Any) -> None:
    tok = ingress.tokenizer
    out = call(ingress.tokenize, {"messages": CHAT})
    assert out["tokens"] == tok.encode_chat(CHAT)
    assert out["count"] == len(out["tokens"])
    no_prompt = call(ingress.tokenize, {"messages": CHAT, "add_generation_prompt": False})
    assert no_prompt["tokens"] == tok.encode_chat(CHAT, add_generation_prompt=False)
    kwargs = call(ingress.tokenize, {"messages": CHAT, "chat_template_kwargs": {"x": 1}})
    assert kwargs["tokens"] == out["tokens"]  # a variable the template does not read


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("tokenize", {"prompt": "word " * 400}, 400, "prompt"),
    ("tokenize", {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    ("tokenize", {"prompt": "hi", "messages": CHAT}, 400, None),
    ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "tokens"),
    ("detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
def test_bad_bodies_are_4xx(ingress: Any, route: str, body: dict[str, Any], status: int,
                            param: str | None) -> None:
    exc = error(getattr(ingress, route), body)
    assert exc.status == status
    if param is not None:
        assert exc.body.error.param == param


def test_version_and_model_card(ingress: Any) -> None:
    assert asyncio.run(ingress.version()) == {"version": VERSION}
    card = asyncio.run(ingress.model(BUILTIN_MODEL_NAME))
    assert (card["id"], card["object"], card["max_model_len"]) == (
        BUILTIN_MODEL_NAME, "model", MAX_MODEL_LEN)
    with pytest.raises(ApiError) as exc:
        asyncio.run(ingress.model("nope"))
    assert exc.value.status == 404
    assert json.loads(exc.value.response().body)["error"]["code"] == "model_not_found"


def test_api_key_is_the_default_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    both = IngressConfig(api_key="sk-one", api_keys={"sk-a": "acme"})
    assert both.key_tenants == {"sk-a": "acme", "sk-one": "default"}
    assert "sk-one" not in repr(both) and "sk-one" not in repr(ClusterConfig(
        policy="pow2", **{"api-key": "sk-one"}))
    settings = GuardSettings.of(both)
    assert sorted(settings.key_tenants.values()) == ["acme", "default"]
    assert "sk-one" not in repr(settings)
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    assert IngressConfig().key_tenants == {"sk-env": "default"}
    with pytest.raises(ValueError, match="surrounding spaces") as exc:
        IngressConfig(api_key=" sk-x ")
    assert "sk-x" not in str(exc.value)


def test_app_args_refuse_an_inline_api_key() -> None:
    from prefixserve.cluster.app import app_builder

    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        app_builder({"policy": "pow2", "api_key": "sk-inline"})
