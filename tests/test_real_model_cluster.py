"""The whole cluster on the default real model, through the official `openai` client: a real
answer, and the second question of a conversation served from the first one's prefix cache on
the same worker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from servekit import serve_app

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.workers.checkpoints import DEFAULT_MODEL

pytestmark = pytest.mark.cluster

APP = "real-model"
SYSTEM = ("You are a helpful geography assistant for a travel company. Answer every question in "
          "one short sentence, name the place exactly, and never add greetings or follow-up "
          "questions. Customers ask about capitals, rivers, mountains and famous landmarks.")


@pytest.fixture(scope="module")
def client(redis_server: LocalRedis) -> Iterator[openai.OpenAI]:
    config = ClusterConfig(redis_url=redis_server.url, num_workers=2, cpus_per_worker=0.5,
                           cpus_per_ingress=0.25, kv_cache_memory_bytes=128 * 2**20,
                           max_model_len=2048, max_num_seqs=8)
    assert config.model == DEFAULT_MODEL  # the default, not the tiny test model
    with serve_app(config, APP, ready_timeout_s=240) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, question: str) -> tuple[str, int, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    chat = raw.parse()
    cached = chat.usage.prompt_tokens_details.cached_tokens
    return chat.choices[0].message.content, cached, raw.headers["x-prefixserve-worker"]


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]


def test_a_real_answer_then_a_prefix_hit_on_the_same_worker(client: openai.OpenAI) -> None:
    answer, cached, worker = _ask(client, "What is the capital of France?")
    assert "Paris" in answer
    assert cached == 0
    time.sleep(1.0)  # the worker's KV events reach the index
    answer2, cached2, worker2 = _ask(client, "What is the capital of Italy?")
    assert "Rome" in answer2
    assert cached2 >= 32
    assert worker2 == worker


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    is_capital: bool


def test_the_openai_client_parses_a_structured_answer(client: openai.OpenAI) -> None:
    """`client.chat.completions.parse(response_format=Model)`: a json_schema response format
    the worker compiles to a grammar; the answer is a valid instance."""
    chat = client.chat.completions.parse(
        model=DEFAULT_MODEL, temperature=0, max_tokens=80, response_format=City,
        messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}])
    city = chat.choices[0].message.parsed
    assert isinstance(city, City), chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert city.name == "Paris"


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def test_the_openai_client_parses_a_tool_call(client: openai.OpenAI) -> None:
    """`tool_choice: required` with a pydantic tool: the worker holds the answer to the tool's
    schema, and the client's `.parse()` returns the arguments as an instance."""
    chat = client.chat.completions.parse(
        model=DEFAULT_MODEL, temperature=0, max_tokens=60, tool_choice="required",
        tools=[openai.pydantic_function_tool(GetWeather)],
        messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}])
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather), call.function.arguments
    assert "Paris" in call.function.parsed_arguments.city
