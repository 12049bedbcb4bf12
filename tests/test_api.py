"""The OpenAI HTTP API end to end: real Ray Serve, real Redis, real HTTP, the built-in model.

One module-scoped cluster (ingress + 2 CPU workers with fractional CPUs) serves every test.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import peft
import pytest
import torch
import transformers
from ray import serve
from servekit import replica_logs, serve_app, wait_for

from prefixserve.cluster.api import VERSION
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis, free_port
from prefixserve.cluster.render import WORKER_HEADER, sse, sse_body
from prefixserve.cluster.responses import CompletionChoice, CompletionChunk
from prefixserve.cluster.tokenizer import Tokenizer
from prefixserve.workers.builtin import EOT_ID, ensure_builtin_model
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

APP = "prefixserve-test"
METRICS_PORT = free_port()
MAX_MODEL_LEN = 512
@pytest.mark.cluster
def test_a_lora_adapter_is_a_model_with_its_own_prefixes(
        base_url: str, tok: Tokenizer, tiny_lora: tuple[Path, torch.nn.Module]) -> None:
    """`model` names the adapter: its greedy text is PEFT's; the same prompt on the base model
    finds none of the adapter's blocks; the adapter's repeat goes to the worker holding its
    prefix and hits it."""
    prompt = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(37)).tolist()
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            tokens.append(int(tiny_lora[1](torch.tensor([tokens])).logits[0, -1].argmax()))
    first = post(base_url, "/v1/completions", body | {"model": "tiny-lora"})
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "tiny-lora"
    assert first.json()["choices"][0]["text"] == tok.decode(tokens[40:])
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(1.0)  # the worker's KV events reach the index
    base = post(base_url, "/v1/completions", body)
    assert base.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]
    assert base.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = post(base_url, "/v1/completions", body | {"model": "tiny-lora"})
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert again.headers[WORKER_HEADER] == first.headers[WORKER_HEADER]


@pytest.mark.cluster
def test_lora_adapters_load_and_unload_at_run_time(
        base_url: str, tok: Tokenizer, tiny_lora: tuple[Path, torch.nn.Module],
        tmp_path: Path) -> None:
    """vLLM's endpoints: a bad adapter is a 400 with the reason and is not served; a good one
    is a model at once (the same weights under another name share no KV with the first);
    unloaded, it is a 404."""
    path = str(tiny_lora[0])
    taken = post(base_url, "/v1/load_lora_adapter", {"lora_name": "tiny-lora", "lora_path": path})
    assert (taken.status_code, taken.json()["error"]["param"]) == (400, "lora_name")
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2))
    peft.get_peft_model(other, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "other")
    for bad, reason in ((tmp_path / "missing", "adapter_config.json is missing"),
                        (tmp_path / "other", "an adapter of another base model")):
        r = post(base_url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(bad)})
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "lora_path"
    assert "late" not in [m["id"] for m in httpx.get(f"{base_url}/v1/models").json()["data"]]
    r = post(base_url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert r.status_code == 200 and r.text.startswith("Success"), r.text
    assert httpx.get(f"{base_url}/v1/models/late").json()["parent"] == BUILTIN_MODEL_NAME
    prompt = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(41)).tolist()
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = post(base_url, "/v1/completions", body | {"model": "tiny-lora"}).json()
    time.sleep(1.0)  # the worker's KV events reach the index
    late = post(base_url, "/v1/completions", body | {"model": "late"}).json()
    assert late["model"] == "late"
    assert late["choices"][0]["text"] == first["choices"][0]["text"]  # the same weights
    assert late["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another adapter
    r = post(base_url, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200, r.text
    gone = post(base_url, "/v1/completions", body | {"model": "late"})
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "model_not_found")
    again = post(base_url, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert again.status_code == 404


WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                         "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Now.",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random LoRA adapter for the built-in model, made with PEFT, and PEFT's model."""
    base = transformers.AutoModelForCausalLM.from_pretrained(ensure_builtin_model()).float()
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("lora") / "tiny-lora"
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def base_url(redis_server: LocalRedis, tiny_lora: tuple[Path, torch.nn.Module]) -> Iterator[str]:
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME,
        redis_url=redis_server.url, num_workers=2, cpus_per_worker=0.5, cpus_per_ingress=0.25,
        num_blocks=128, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
        enable_auto_tool_choice=True, tool_call_parser="hermes",
        lora_modules={"tiny-lora": str(tiny_lora[0])}, allow_runtime_lora_updating=True,
    )
    with serve_app(config, APP, _metrics_export_port=METRICS_PORT,
                   _system_config={"metrics_report_interval_ms": 1000}) as url:
        yield url


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_builtin_model())


def post(url: str, path: str, body: dict | str, **kw) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def sse_events(url: str, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of an SSE response, in order."""
    events = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line.removeprefix("data: "))
    return events


@pytest.mark.cluster
def test_models_and_health(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{base_url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["parent"]) for m in models["data"]] == [
        (BUILTIN_MODEL_NAME, None), ("tiny-lora", BUILTIN_MODEL_NAME)]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    missing = httpx.get(f"{base_url}/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.cluster
def test_completion(base_url: str, tok: Tokenizer) -> None:
    body = {"model": BUILTIN_MODEL_NAME, "prompt": "Hello there", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    assert out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(tok.encode("Hello there"))
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert r.headers[WORKER_HEADER]
    again = post(base_url, "/v1/completions", body).json()
    assert again["choices"][0]["text"] == choice["text"]  # greedy is deterministic


@pytest.mark.cluster
def test_completion_stream_matches_non_stream(base_url: str) -> None:
    body = {"prompt": [72, 105, 33], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post(base_url, "/v1/completions", body).json()["choices"][0]["text"]
    events = sse_events(base_url, "/v1/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == 3
    streamed = [c for c in chunks[:-1]]
    assert all(c["object"] == "text_completion" for c in streamed)
    assert "".join(c["choices"][0]["text"] for c in streamed) == text
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in streamed[:-1])
    no_usage = sse_events(base_url, "/v1/completions", {**body, "stream": True})
    assert all(json.loads(e).get("usage") is None for e in no_usage[:-1])


@pytest.mark.cluster
def test_chat(base_url: str) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = post(base_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 6
    events = sse_events(base_url, "/v1/chat/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert content == msg["content"]


@pytest.mark.cluster
def test_n_samples_and_seed(base_url: str) -> None:
    body = {"prompt": "abc", "max_tokens": 5, "n": 3, "seed": 11, "temperature": 1.0,
            "ignore_eos": True}
    out = post(base_url, "/v1/completions", body).json()
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 15
    assert post(base_url, "/v1/completions", body).json()["choices"] == out["choices"]
    batch = post(base_url, "/v1/completions",
                 {"prompt": ["abc", "xyz"], "max_tokens": 3, "n": 2, "ignore_eos": True}).json()
    assert [c["index"] for c in sorted(batch["choices"], key=lambda c: c["index"])] == [0, 1, 2, 3]
    assert batch["usage"]["completion_tokens"] == 12


@pytest.mark.cluster
def test_stop_string_truncates(base_url: str) -> None:
    body = {"prompt": "The stop test", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = post(base_url, "/v1/completions", body).json()["choices"][0]["text"]
    # random weights: the text is arbitrary, so take a stop string from it (not a U+FFFD)
    usable = [i for i in range(2, len(text)) if text[i] != "\ufffd"]
    assert usable, f"no usable stop string in {text!r}"
    stop = text[usable[0]]
    expected = text[: text.find(stop)]
    out = post(base_url, "/v1/completions", {**body, "stop": [stop]}).json()
    assert out["choices"][0]["text"] == expected
    assert out["choices"][0]["finish_reason"] == "stop"
    events = sse_events(base_url, "/v1/completions", {**body, "stop": stop, "stream": True})
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.cluster
def test_logprobs(base_url: str) -> None:
    out = post(base_url, "/v1/completions", {"prompt": "log", "max_tokens": 4, "logprobs": 2,
                                             "temperature": 0, "ignore_eos": True}).json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    # greedy: the chosen token is the most likely one (keys are texts: broken bytes collide)
    assert all(v >= max(top.values()) - 1e-4
               for top, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)), lp
    chat = post(base_url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "ignore_eos": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content)
    assert all(c["logprob"] <= 0 for c in content)


@pytest.mark.cluster
def test_shared_prefix_reports_cached_tokens(base_url: str) -> None:
    shared = "You are a helpful assistant. " * 12  # ~360 byte tokens: many full blocks
    first = post(base_url, "/v1/completions",
                 {"prompt": shared + "Question one?", "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(0.5)  # let the worker's KV events reach the index
    second = post(base_url, "/v1/completions",
                  {"prompt": shared + "Question two?", "max_tokens": 2}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * 20
    assert cached % 16 == 0
    salted = post(base_url, "/v1/completions", {"prompt": shared + "Question two?",
                                                "max_tokens": 2, "cache_salt": "tenant-b"})
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.cluster
def test_openai_client(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    comp = client.completions.create(model=BUILTIN_MODEL_NAME, prompt="Hi", max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 4
    assert isinstance(comp.choices[0].text, str)
    chat = client.chat.completions.create(
        model=BUILTIN_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(
        model=BUILTIN_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BUILTIN_MODEL_NAME, prompt="Hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", '{"prompt": "x",', 400, None),
        ("/v1/completions", "", 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x" * 500, "max_tokens": 100}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, -3]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
         "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400,
         "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "stream": True, "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, 400,
         "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema",
         "json_schema": {"schema": {"type": "nonsense"}}}}, 400, "response_format"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"}, 400, "guided_regex"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "structured_outputs": {"grammar": "root ::= nothing"}}, 400,
         "structured_outputs.grammar"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "min_p": 2}, 400, "min_p"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "structured_outputs": {"structural_tag": {"type": "tag"}}},
         400, "structured_outputs.structural_tag"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tool_choice": "required"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"description": "no name"}}]}, 400,
         "tools.0.function.name"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
             "required": "city"}}}]}, 400, "tools.0.function.parameters"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": TOOLS, "tool_choice": {
                                      "type": "function", "function": {"name": "nope"}}}, 400,
         "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}],
            "tool_choice": "required"}, 400, "tools"),  # the worker cannot compile it
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "21"}]}, 400,
         "messages.0"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
         400, "messages.0.tool_calls.0.function.arguments"),
    ],
)
def test_bad_input_is_a_4xx_envelope(base_url: str, path: str, body: dict | str, status: int,
                                     param: str | None) -> None:
    r = post(base_url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"




def stream_chat(url: str, body: dict) -> list[tuple[str | None, list[list[str]], str | None]]:
    """A streamed chat reassembled as a client does, per choice: content, calls ([id, name,
    arguments]; id and name in the call's first delta, alone), finish reason."""
    events = [json.loads(e) for e in sse_events(url, "/v1/chat/completions",
                                                body | {"stream": True}) if e != "[DONE]"]
    out: list[tuple[str | None, list[list[str]], str | None]] = []
    for i in range(body.get("n", 1)):
        content, calls, finish = None, [], None
        for event in events:
            for choice in event["choices"]:
                if choice["index"] != i:
                    continue
                delta = choice["delta"]
                if delta.get("content"):
                    content = (content or "") + delta["content"]
                for call in delta.get("tool_calls", []):
                    if "id" in call:
                        assert call["index"] == len(calls) and call["type"] == "function"
                        assert call["function"]["arguments"] == ""
                        calls.append([call["id"], call["function"]["name"], ""])
                    else:
                        assert set(call) == {"index", "function"}
                        calls[call["index"]][2] += call["function"]["arguments"]
                finish = choice["finish_reason"] or finish
        out.append((content, calls, finish))
    return out


def _regex_of(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text)


@pytest.mark.cluster
def test_tool_choice_required_and_named_give_valid_calls(base_url: str) -> None:
    """Constrained by grammar, the random-weight model's calls name the tools and their
    arguments fit the tools' schemas; the stream reassembles to the same calls; n=2 and
    parallel_tool_calls=false hold too."""
    user = [{"role": "user", "content": "What now?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, names in (("required", set(SCHEMAS)), (named, {"get_time"})):
        body = {"messages": user, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 120,
                "temperature": 0, "parallel_tool_calls": False}
        r = post(base_url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1
        call = message["tool_calls"][0]
        assert call["type"] == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}",
                                                           call["id"])
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
        [(content, calls, finish)] = stream_chat(base_url, body)
        assert (content, finish) == (None, "tool_calls")
        assert [c[1:] for c in calls] == [[call["function"]["name"],
                                           call["function"]["arguments"]]]
    body = {"messages": user, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "n": 2, "seed": 5}
    r = post(base_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        calls = choice["message"]["tool_calls"]
        assert calls and len({c["id"] for c in calls}) == len(calls)
        finished = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]
        for c in finished:
            jsonschema.validate(json.loads(c["function"]["arguments"]),
                                SCHEMAS[c["function"]["name"]])


@pytest.mark.cluster
def test_auto_tool_choice_reads_the_models_calls(base_url: str) -> None:
    """tool_choice auto (the default with tools) reads hermes calls out of the text: here the
    text is held to one by a regex, so the random-weight model writes it. Content before the
    call is content; the stream reassembles to the same answer. With `none` the same text is
    just text."""
    call = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
    text = f"Sure. <tool_call>\n{call}\n</tool_call>"
    body = {"messages": [{"role": "user", "content": "Rome?"}], "tools": TOOLS,
            "max_tokens": 160, "structured_outputs": {"regex": _regex_of(text)}}
    r = post(base_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [got] = choice["message"]["tool_calls"]
    assert (got["function"]["name"], json.loads(got["function"]["arguments"])) == (
        "get_weather", {"city": "Rome", "days": 2})
    [(content, calls, finish)] = stream_chat(base_url, body)
    assert (content, [c[1:] for c in calls], finish) == (
        "Sure.", [["get_weather", got["function"]["arguments"]]], "tool_calls")
    r = post(base_url, "/v1/chat/completions", body | {"tool_choice": "none"})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": text,
                                                 "tool_calls": []}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.cluster
def test_tool_history_renders_through_the_template(base_url: str, tok: Tokenizer) -> None:
    """An assistant turn of tool calls (no content) and the tool's result reach the template;
    /tokenize with the same tools counts the same prompt."""
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'}]
    r = post(base_url, "/v1/chat/completions", {"messages": chat, "tools": TOOLS,
                                                "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'}]
    expected = tok.encode_chat(messages, tools=TOOLS)
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    counted = post(base_url, "/tokenize", {"messages": chat, "tools": TOOLS})
    assert counted.json()["tokens"] == expected


STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "mood": {"enum": ["calm", "busy"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9},
    "ok": {"type": "boolean"}}, "required": ["mood", "count", "ok"], "additionalProperties": False}


@pytest.mark.cluster
def test_structured_outputs_constrain_the_text(base_url: str) -> None:
    """Each way of asking, on both endpoints, streamed and not: the random-weight model's text
    fits the constraint, and a stream reassembles to the same answer."""
    user = [{"role": "user", "content": "Report."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": STRUCTURED_SCHEMA,
                                                  "strict": True}}
    body = {"messages": user, "response_format": fmt, "max_tokens": 60, "temperature": 0}
    r = post(base_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    answer = json.loads(choice["message"]["content"])
    assert set(answer) == {"mood", "count", "ok"} and answer["mood"] in ("calm", "busy")
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body | {"stream": True},
                      timeout=60) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == choice["message"]["content"]
    choices = ["north", "south", "east west"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = post(base_url, "/v1/completions",
                 {"prompt": "Go", "max_tokens": 8, "n": 2, "seed": 1} | extra)
        assert r.status_code == 200, r.text
        assert all(c["text"] in choices for c in r.json()["choices"])
    r = post(base_url, "/v1/completions", {"prompt": "Id", "max_tokens": 12, "temperature": 0,
                                           "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", r.json()["choices"][0]["text"]), r.text


@pytest.mark.cluster
def test_vllm_sampling_fields_reach_the_sampler(base_url: str, tok: Tokenizer) -> None:
    forced = tok.encode("a", add_special_tokens=False)[-1]
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(forced): 100}}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([forced] * 4)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "seed": 3,
            "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
            "min_p": 0.1, "min_tokens": 6, "top_k": 20, "response_format": {"type": "text"}}
    r = post(base_url, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6  # min_tokens: no early EOS


@pytest.mark.cluster
def test_vllm_output_options_over_http(base_url: str, tok: Tokenizer) -> None:
    a = tok.encode("a", add_special_tokens=False)[-1]

    def choice(extra: dict, stream: bool = False) -> dict:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logit_bias": {str(a): 100}}
        if stream:
            events = sse_events(base_url, "/v1/completions", body | extra | {"stream": True})
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            return {"text": "".join(c["text"] for c in chunks),
                    "stop_reason": chunks[-1]["stop_reason"]}
        r = post(base_url, "/v1/completions", body | extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    # a stop token ends the text before it and is named; vLLM's option keeps its text
    for stream in (False, True):
        got = choice({"stop_token_ids": [a]}, stream)
        assert (got["text"], got["stop_reason"]) == ("", a)
        got = choice({"stop_token_ids": [a], "include_stop_str_in_output": True}, stream)
        assert (got["text"], got["stop_reason"]) == ("a", a)
        got = choice({"stop": ["aa"], "include_stop_str_in_output": True}, stream)
        assert (got["text"], got["stop_reason"]) == ("aa", "aa")
    assert choice({"stop": ["aa"]})["text"] == ""
    assert choice({})["stop_reason"] is None  # ended by length
    # EOS: skipped as a special token; written with skip_special_tokens false and kept
    eot = {"logit_bias": {str(EOT_ID): 100}}
    got = choice(eot)
    assert (got["text"], got["finish_reason"], got["stop_reason"]) == ("", "stop", None)
    kept = choice(eot | {"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert kept["text"] == "<|eot_id|>"
    # only the allowed tokens are drawn
    allowed = tok.encode("xyz", add_special_tokens=False)
    r = post(base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "seed": 5,
                                           "ignore_eos": True, "allowed_token_ids": allowed})
    text = r.json()["choices"][0]["text"]
    assert len(text) == 12 and set(text) <= set("xyz"), text
    # the prompt's last k tokens; the BOS only when asked
    usage = [post(base_url, "/v1/completions", {"prompt": "Hello world", "max_tokens": 1} | x
                  ).json()["usage"]["prompt_tokens"]
             for x in ({}, {"truncate_prompt_tokens": 3}, {"add_special_tokens": False})]
    assert usage == [12, 3, 11]
    chat = [post(base_url, "/v1/chat/completions", {"max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}]} | x).json()["usage"]["prompt_tokens"]
            for x in ({}, {"add_special_tokens": True}, {"truncate_prompt_tokens": 4})]
    assert chat[1] == chat[0] + 1 and chat[2] == 4  # BOS again before the template's
    r = post(base_url, "/v1/completions", {"prompt": "x", "prompt_logprobs": 2})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt_logprobs")


@pytest.mark.cluster
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(base_url: str,
                                                                    path: str) -> None:
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body |= {"prompt": "Hello"} if "chat" not in path else {
        "messages": [{"role": "user", "content": "Hello"}]}
    chunks = [json.loads(e) for e in sse_events(base_url, path, body)[:-1]]
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert used == sorted(used) and used[-1] == 6 and len(chunks) > 2
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    body["stream_options"] = {"include_usage": True}  # only the last chunk carries it
    chunks = [json.loads(e) for e in sse_events(base_url, path, body)[:-1]]
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]


@pytest.mark.cluster
def test_streamed_text_with_unicode_line_breaks_arrives_whole(base_url: str,
                                                              tok: Tokenizer) -> None:
    # U+0085 is two byte tokens; both forced, and the penalties make greedy decoding alternate.
    nel = tok.encode("\x85", add_special_tokens=False)
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(t): 100 for t in nel}, "frequency_penalty": 2.0,
            "presence_penalty": 2.0, "stream": True}
    events = sse_events(base_url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert "\x85" in text, repr(text)
    whole = post(base_url, "/v1/completions", {**body, "stream": False}).json()
    assert text == whole["choices"][0]["text"]


@pytest.mark.cluster
def test_context_error_mentions_the_limit_and_cluster_keeps_serving(base_url: str) -> None:
    r = post(base_url, "/v1/completions", {"prompt": "x" * 600, "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in r.json()["error"]["message"]
    assert post(base_url, "/v1/nothing", {}).status_code == 404
    ok = post(base_url, "/v1/completions", {"prompt": "still fine", "max_tokens": 2})
    assert ok.status_code == 200


def _engines_idle(deadline_s: float = 20.0) -> bool:
    handle = serve.get_deployment_handle("LLMWorker", APP)
    idle: dict[str, bool] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        s = handle.stats.remote().result()
        idle[s["worker"]] = s["num_running"] == 0 and s["num_waiting"] == 0
        if len(idle) == 2 and all(idle.values()):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.cluster
def test_client_disconnect_frees_the_worker(base_url: str) -> None:
    body = {"prompt": "long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # 480 tokens would take many seconds; the abort must free the engine well before that
    assert _engines_idle()


async def test_error_mid_stream_sends_error_event_then_done() -> None:
    async def chunks() -> AsyncIterator[str]:
        yield "data: {}\n\n"
        raise RuntimeError("worker died")

    out = [c async for c in sse_body("data: first\n\n", chunks())]
    assert out[0] == "data: first\n\n"
    assert out[-1] == "data: [DONE]\n\n"
    error = json.loads(out[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error"


def test_an_event_stays_one_line_for_readers_that_split_on_unicode_breaks() -> None:
    text = "a\x85b\u2028c\u2029d\ne"
    chunk = CompletionChunk(id="c", created=0, model="m",
                            choices=[CompletionChoice(index=0, text=text)])
    event = sse(chunk)
    httpx_lines = list(httpx.Response(200, content=event.encode()).iter_lines())
    for lines in (event.splitlines(), httpx_lines):
        assert lines == [event.removesuffix("\n\n"), ""]
    assert json.loads(event.removeprefix("data: "))["choices"][0]["text"] == text


def _scrape(names: list[str], deadline_s: float = 30.0) -> dict[str, list[str]]:
    """Prometheus lines of each metric, once every one of them has been exported."""
    deadline = time.monotonic() + deadline_s
    while True:
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).text
        found = {n: [ln for ln in text.splitlines() if ln.startswith(n)] for n in names}
        if all(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.cluster
def test_prometheus_metrics_per_worker(base_url: str) -> None:
    system = "Metrics are labelled by worker. " * 12
    for question in ("one", "two"):
        body = {"prompt": system + question, "max_tokens": 2, "temperature": 0}
        assert post(base_url, "/v1/completions", body).status_code == 200
    # vLLM's names and labels, as Ray's Serve LLM dashboard queries them (tests/
    # test_metrics_names.py pins the full set against its panels)
    names = [
        "ray_vllm_prefix_cache_queries_total", "ray_vllm_prefix_cache_hits_total",
        "ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total",
        "ray_vllm_request_success_total", "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
        "ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_request_queue_time_seconds_sum",
        "ray_vllm_e2e_request_latency_seconds_count",
        "ray_vllm_request_time_per_output_token_seconds_bucket",
        "ray_vllm_request_prompt_tokens_sum",
        "ray_prefixserve_router_latency_seconds_bucket",
        "ray_prefixserve_router_matched_blocks_count",
    ]
    found = _scrape(names)
    assert all(found.values()), [n for n, lines in found.items() if not lines]
    for name in names[:-2]:
        assert any('model_name="' in ln and 'WorkerId="' in ln for ln in found[name]), name
    hits = [ln for ln in found["ray_vllm_prefix_cache_hits_total"] if 'worker="' in ln]
    assert hits and max(float(ln.rsplit(" ", 1)[1]) for ln in hits) > 0
    done = found["ray_vllm_request_success_total"]
    assert any('finished_reason="length"' in ln for ln in done)


@pytest.mark.cluster
def test_access_log_has_a_line_per_request_by_default(base_url: str) -> None:
    resp = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
    assert wait_for(lambda: "POST /v1/completions 200" in replica_logs(APP, "OpenAIIngress"), 10)
    assert "CALL generate OK" in replica_logs(APP, "LLMWorker")


@pytest.mark.cluster
def test_vllm_tokenizer_endpoints_over_http(base_url: str, tok: Tokenizer) -> None:
    """/tokenize, /detokenize and /version in vLLM's shapes, through Serve's proxy."""
    assert httpx.get(f"{base_url}/version").json() == {"version": VERSION}
    card = httpx.get(f"{base_url}/v1/models/{BUILTIN_MODEL_NAME}").json()
    assert (card["id"], card["max_model_len"]) == (BUILTIN_MODEL_NAME, MAX_MODEL_LEN)
    out = post(base_url, "/tokenize", {"model": BUILTIN_MODEL_NAME, "prompt": "Hello there"})
    assert out.json() == {"count": len(tok.encode("Hello there")), "max_model_len": MAX_MODEL_LEN,
                          "tokens": tok.encode("Hello there"), "token_strs": None}
    chat = [{"role": "user", "content": "Hi"}]
    assert post(base_url, "/tokenize", {"messages": chat}).json()["tokens"] == \
        tok.encode_chat(chat)
    back = post(base_url, "/detokenize", {"tokens": out.json()["tokens"]})
    assert back.json() == {"prompt": tok.decode(out.json()["tokens"], skip_special_tokens=False)}
    for path, body in [("/detokenize", {"tokens": [10**9]}), ("/tokenize", {"prompt": 1}),
                       ("/tokenize", {"model": "nope", "prompt": "x"})]:
        r = post(base_url, path, body)
        assert r.status_code in (400, 404) and "error" in r.json(), (path, r.text)
