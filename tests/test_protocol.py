"""Validation of the OpenAI request models: what is accepted, what is a clear 400."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from prefixserve.cluster.api_schema import format_validation_error
from prefixserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from prefixserve.cluster.responses import ErrorResponse, Usage
from prefixserve.router.sampling_params import SamplingParams


def _error(model: type, body: dict | str) -> tuple[str, str | None]:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(raw)
    return format_validation_error(info.value)


def test_completion_prompt_forms() -> None:
    assert CompletionRequest.model_validate_json('{"prompt": "hi"}').prompts() == ["hi"]
    assert CompletionRequest.model_validate_json('{"prompt": [1, 2]}').prompts() == [[1, 2]]
    batch = CompletionRequest.model_validate_json('{"prompt": ["a", "b"]}')
    assert batch.prompts() == ["a", "b"]
    ids = CompletionRequest.model_validate_json('{"prompt": [[1], [2, 3]]}')
    assert ids.prompts() == [[1], [2, 3]]
    assert ids.max_tokens == 16  # OpenAI's default for completions


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": ["a", ""]}, "prompt", "must not be empty"),
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": 5}, "prompt", "must be a string"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "x", "n": 17}, "n", "less than or equal to 16"),
        ({"prompt": "x", "temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "stop": ""}, "stop", "must not be empty"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop", "at most 16"),
        ({"prompt": "x", "stop": "x" * 300}, "stop", "at most 256"),
        ({"prompt": "x", "seed": -1}, "seed", "greater than or equal to 0"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "greater than or equal"),
        ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty", "valid number"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"prompt": "x", "min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"prompt": "x", "min_tokens": 17}, None, "min_tokens (17) must not exceed"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "biases must be in [-100"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
         "at most 1024"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format",
         "type must be text, json_object, json_schema or structural_tag"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, None,
         "give one structured output, not 2 (guided_regex, guided_choice)"),
        ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs", "exactly one of json, regex, choice, grammar, structural_tag"),
        ({"prompt": "x", "structured_outputs": {"structural_tag": 5}},
         "structured_outputs.structural_tag.str", "valid string"),
        ({"prompt": "x", "response_format": {"type": "structural_tag"},
          "structured_outputs": {"structural_tag": "{}"}}, None,
         "not 2 (response_format, structured_outputs.structural_tag)"),
        ({"prompt": "x", "guided_grammar": "x" * 70000}, None, "longer than 65536"),
        ({"prompt": "x", "guided_json": {"properties": {"a": {"$ref": "http://x/s.json"}}}},
         None, "guided_json: only local $refs (\"#...\") are supported, got 'http://x/s.json'"),
        ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "schema": {"items": [{"$ref": "other.json#/a"}]}}}}, None,
         "response_format: only local $refs"),
        ({"prompt": "x", "structured_outputs": {"json": '{"$ref": "s.json"}'}}, None,
         "structured_outputs: only local $refs"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "best_of": 2}, None, "best_of is not supported"),
        ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
        ({"prompt": "x", "bad_words": ["no"]}, "bad_words", "not supported"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "not supported"),
        ({"prompt": "x", "priority": -1}, "priority", "not supported"),
        ({"prompt": "x", "logits_processors": ["mod.fn"]}, "logits_processors", "not supported"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
        ({"prompt": "x", "allowed_token_ids": [3, -1]}, "allowed_token_ids", "non-negative"),
        ({"prompt": "x", "allowed_token_ids": list(range(1025))}, "allowed_token_ids",
         "at most 1024"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
         "greater than or equal to 1"),
        ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output",
         "valid boolean"),
        ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt", "at least 1 character"),
        ({}, "prompt", "Field required"),
    ],
)
def test_completion_rejects(body: dict, param: str, fragment: str) -> None:
    message, got_param = _error(CompletionRequest, body)
    assert got_param == param
    assert fragment in message


def test_nan_and_malformed_json_are_rejected() -> None:
    message, param = _error(CompletionRequest, '{"prompt": "x", "temperature": NaN}')
    assert param == "temperature"
    assert "finite" in message
    message, param = _error(CompletionRequest, '{"prompt": "x",')
    assert param is None
    assert "not valid JSON" in message
    assert "object" in _error(CompletionRequest, "[1, 2]")[0]


def test_unknown_fields_are_ignored_and_neutral_values_accepted() -> None:
    req = CompletionRequest.model_validate_json(json.dumps({
        "prompt": "x", "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
        "best_of": 1, "some_sdk_field": {"a": 1}, "stream_options": {"include_usage": True},
        "response_format": {"type": "text"}, "min_tokens": 0,
    }))
    assert req.include_usage
    assert "some_sdk_field" not in req.model_dump()
    ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"},
    }))
    local = {"$defs": {"a": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/a"}}}
    for body in ({"guided_json": local}, {"structured_outputs": {"json": json.dumps(local)}},
                 {"guided_regex": "$ref"}, {"structured_outputs": {"json": "{not json"}}):
        assert CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **body}))
    # every refused field at its neutral value (what it means when absent) is no error
    neutral = {"prompt_logprobs": None, "bad_words": [], "use_beam_search": False,
               "length_penalty": 1.0, "logits_processors": None, "priority": 0,
               "guided_whitespace_pattern": None, "return_tokens_as_token_ids": False,
               "vllm_xargs": {}}
    CompletionRequest.model_validate_json(json.dumps(
        {"prompt": "x", "echo": False, "suffix": None, **neutral}))
    ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": "x"}], "echo": False, "best_of": 1,
        "continue_final_message": False, "chat_template": None, "functions": None,
        "modalities": ["text"], **neutral}))


def test_vllm_output_options() -> None:
    req = CompletionRequest.model_validate_json(json.dumps({
        "prompt": [5, 6, 7], "allowed_token_ids": [3, 9], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "spaces_between_special_tokens": False,
        "truncate_prompt_tokens": 2, "add_special_tokens": False}))
    assert req.sampling_params(4, None).allowed_token_ids == (3, 9)
    assert (req.include_stop_str_in_output, req.skip_special_tokens) == (True, False)
    assert (req.truncate_prompt_tokens, req.add_special_tokens) == (2, False)
    plain = CompletionRequest.model_validate_json('{"prompt": "x"}')
    assert plain.sampling_params(4, None).allowed_token_ids is None
    assert (plain.include_stop_str_in_output, plain.skip_special_tokens) == (False, True)
    assert (plain.truncate_prompt_tokens, plain.add_special_tokens) == (None, True)
    chat = ChatCompletionRequest.model_validate_json('{"messages":[{"role":"user","content":""}]}')
    assert chat.add_special_tokens is False  # vLLM's default: the template writes BOS


def test_sampling_params() -> None:
    req = CompletionRequest.model_validate_json(json.dumps({
        "prompt": "x", "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 7, "n": 2,
        "stop": "END", "stop_token_ids": [3], "ignore_eos": True,
    }))
    assert req.sampling_params(5, 2) == SamplingParams(
        n=2, ignore_eos=True, temperature=0.0, top_p=0.5, top_k=0, seed=7,
        stop_token_ids=(3,), max_tokens=5, logprobs=2,
    )
    assert req.stop_strings == ["END"]
    plain = CompletionRequest.model_validate_json('{"prompt": "x"}').sampling_params(16, None)
    assert plain == SamplingParams(max_tokens=16)
    vllm = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 8,
        "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"7": -100, "12": 2.5},
        "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 8,
    }))
    assert vllm.sampling_params(8, None) == SamplingParams(
        max_tokens=8, frequency_penalty=0.5, presence_penalty=-1.0,
        logit_bias={7: -100.0, 12: 2.5}, repetition_penalty=1.1, min_p=0.05, min_tokens=8,
    )


def test_chat_messages() -> None:
    req = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                        "text": "b"}]},
        ],
        "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2,
    }))
    assert [m.text() for m in req.messages] == ["be brief", "ab"]
    assert req.max_output_tokens == 7
    assert req.num_logprobs == 2
    plain = ChatCompletionRequest.model_validate_json('{"messages":[{"role":"user","content":""}]}')
    assert plain.max_output_tokens is None
    assert plain.num_logprobs is None


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
        ({"messages": [{"role": "user"}]}, "messages.0", "content is required"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0",
         "only assistant messages carry tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages.0.tool_calls.0.function.arguments", "a JSON object"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls.0.id", "at least 1 character"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "text parts"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0.content", "only text content parts"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None,
         "requires logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools.0.function", "Field required"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function", "function": {"description": "no name"}}]},
         "tools.0.function.name", "Field required"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function", "function": {"name": "get weather"}}]},
         "tools.0.function.name", "1 to 64 letters"),
        ({"messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
         "tools.0.type", "'function'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
          "function": {"name": "f", "parameters": {"type": "object",
                                                   "properties": {"a": {"type": "strin"}}}}}]},
         "tools.0.function.parameters", "not a valid JSON schema at properties/a/type"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
          "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools.0.function.parameters", "of type object"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "f"}}]}, "tools", "unique"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
         "tool_choice", "needs tools"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes",
          "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tool_choice", 'must be "none", "auto", "required"'),
        ({"messages": [{"role": "user", "content": "x"}],
          "tool_choice": {"type": "function", "function": {"name": "g"}},
          "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tool_choice", "'g', which is not among the tools"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
          "tools": [{"type": "function", "function": {"name": "f"}}],
          "response_format": {"type": "json_object"}},
         None, "give one structured output, not 2 (response_format, tools)"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema", "json_schema": "nope"}},
         "response_format", "json_schema must be an object"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "min_tokens": 4},
         None, "min_tokens (4) must not exceed"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": -100.5}},
         "logit_bias", "biases must be in"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens", "greater than or equal to 1"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {
              "type": "object", "properties": {"a": {"$ref": "https://x/a.json"}}}}}]},
         None, "tools: only local $refs"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content", "needs its `text`"),
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 3}, None,
         "best_of is not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo",
         "not supported"),
        ({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
         "continue_final_message", "not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
         "chat_template", "not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
         "functions", "not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
         "modalities", "not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0},
         "prompt_logprobs", "not supported"),
    ],
)
def test_chat_rejects(body: dict, param: str | None, fragment: str) -> None:
    message, got_param = _error(ChatCompletionRequest, body)
    assert got_param == param
    assert fragment in message


def test_response_shapes() -> None:
    usage = Usage.of(10, 3, cached_tokens=8)
    assert usage.model_dump() == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    err = ErrorResponse.of("bad", param="n").model_dump()
    assert err == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                             "code": None}}


def test_structural_tags_are_structured_outputs() -> None:
    """vLLM takes a structural tag in structured_outputs and as a response_format type; the
    worker compiles it (tests/test_structured.py)."""
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
           "triggers": ["<f>"]}
    for body, field in (({"structured_outputs": {"structural_tag": json.dumps(tag)}},
                         "structured_outputs.structural_tag"),
                        ({"response_format": {"type": "structural_tag", **tag}},
                         "response_format")):
        req = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **body}))
        so = req.structured_output()
        assert so is not None and (so.kind, so.field) == ("structural_tag", field)
        assert json.loads(so.spec)["structures"] == tag["structures"]
