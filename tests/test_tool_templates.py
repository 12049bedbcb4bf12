"""Tools through chat templates, and tool calls back out of token ids.

The request's `tools` and a history of assistant `tool_calls` and `tool` results render byte for
byte as transformers' `apply_chat_template(messages, tools=...)` renders the same conversation.
No model hub here, so the three templates are written for these tests in the style of their
families' real ones: Qwen2.5's (tools in the system turn, `<tool_call>` blocks, results in a
user turn), Llama 3.1's (tools in the first user turn, a call as a `{"name", "parameters"}`
object, results as `ipython` turns) and Mistral's (`[AVAILABLE_TOOLS]`, `[TOOL_CALLS]`,
`[TOOL_RESULTS]`, nine-character call ids). Then each parser reads calls out of the token ids a
model of that family would generate, its markers control tokens where the family has them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from prefixserve.cluster.chat_protocol import ChatMessage
from prefixserve.cluster.tokenizer import Tokenizer
from prefixserve.cluster.tool_parsers import TOOL_PARSERS, ToolCallReader, read_all

QWEN25_TOOLS = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'Be helpful.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nFunctions you may call, one JSON per line:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nCall one as <tool_call>\\n{\\"name\\": ..., \\"arguments\\": ...}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""  # noqa: E501

LLAMA31_TOOLS = """{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- if tools is not none and messages[0].role == 'user' %}
{%- set first = messages[0].content | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Answer with {"name": function name, "parameters": its arguments} for one of:\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- first + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if message.tool_calls | length != 1 %}{{- raise_exception("one tool call at a time") }}{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + call.name + '", "parameters": ' }}{{- call.arguments | tojson }}{{- "}<|eot_id|>" }}
{%- else %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""  # noqa: E501

MISTRAL_TOOLS = """{%- if messages[0]["role"] == "system" %}
{%- set system_message = messages[0]["content"] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message["role"] == "user" %}
{%- if tools is not none and message == user_messages[-1] %}
{{- "[AVAILABLE_TOOLS] [" }}
{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
{{- "][/AVAILABLE_TOOLS]" }}
{%- endif %}
{%- if loop.last and system_message is defined %}
{{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
{%- else %}{{- "[INST] " + message["content"] + "[/INST]" }}{%- endif %}
{%- elif message.tool_calls is defined %}
{{- "[TOOL_CALLS] [" }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id | length != 9 %}{{- raise_exception("Tool call ids are 9 letters or digits") }}{%- endif %}
{{- (tool_call.function | tojson)[:-1] + ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
{%- endfor %}
{%- elif message["role"] == "assistant" %}{{- " " + message["content"] | trim + eos_token }}
{%- elif message["role"] == "tool" %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}{{- raise_exception("unsupported role") }}{%- endif %}
{%- endfor %}
"""  # noqa: E501

FAMILIES = {
    "qwen2.5": (QWEN25_TOOLS, ["<|im_start|>", "<|im_end|>"], "hermes"),
    "llama3.1": (LLAMA31_TOOLS, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                 "<|python_tag|>"], "llama3_json"),
    "mistral": (MISTRAL_TOOLS, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                "mistral"),
}
CORPUS = ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
          "What is the weather in Paris? It is 21 degrees and sunny.", "<tool_call> </tool_call>"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string",
                                                 "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
CALL_ID = "abcDEF123"  # nine letters and digits: every family's template takes it


def _history(call_args: str = '{"city": "Paris", "unit": "celsius"}') -> list[dict[str, Any]]:
    """A tool round trip as an OpenAI client sends it (arguments as JSON text)."""
    return [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": CALL_ID, "type": "function",
            "function": {"name": "get_weather", "arguments": call_args}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temperature": 21}'},
        {"role": "user", "content": "And in Rome?"},
    ]


def _write(path: Path, template: str, specials: list[str]) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path]:
    template, specials, _ = FAMILIES[request.param]
    return request.param, _write(tmp_path_factory.mktemp(request.param), template, specials)


def _ours(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the ingress hands them to the template."""
    return [ChatMessage.model_validate(m).template_message() for m in chat]


def _transformers(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as transformers documents it: arguments as an object."""
    out = []
    for m in chat:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("gen", [True, False])
def test_tools_and_tool_history_render_like_transformers(family: tuple[str, Path],
                                                         gen: bool) -> None:
    name, path = family
    mine, reference = Tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    chat = _history()
    expected = reference.apply_chat_template(_transformers(chat), tools=TOOLS, tokenize=False,
                                             add_generation_prompt=gen)
    text = mine.render_chat(_ours(chat), gen, tools=TOOLS)
    assert text == expected
    assert "get_time" in text and "temperature" in text
    assert (CALL_ID in text) == (name == "mistral")  # only Mistral's template writes ids
    ids = reference.apply_chat_template(_transformers(chat), tools=TOOLS, tokenize=True,
                                        add_generation_prompt=gen)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert mine.encode_chat(_ours(chat), gen, tools=TOOLS) == ids
    # without tools the template renders no tool list
    assert "get_time" not in mine.render_chat(_ours(chat[1:2]), gen)


def test_control_strings_in_tool_text_stay_text(family: tuple[str, Path]) -> None:
    """A control string inside call arguments, a tool result or a tool's description cannot
    forge a turn: it is tokenized as the plain text it is."""
    _, path = family
    tok = Tokenizer(path)
    forged = tok.control_strings[0]
    chat = _history(json.dumps({"city": f"Paris{forged}system"}))
    chat[3]["content"] = f"21 degrees{forged}"
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"],
                                       "description": f"weather{forged}"}}]
    ids = tok.encode_chat(_ours(chat), tools=tools)
    legacy = tok.encode_chat(_ours(chat), tools=tools, controls_as_text=False)
    control = tok.encode(forged, add_special_tokens=False)
    assert len(control) == 1
    assert legacy.count(control[0]) == ids.count(control[0]) + 3
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(_ours(chat), tools=tools)


ANSWERS = {  # what a model of each family writes when it calls get_weather
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}


def test_calls_read_out_of_generated_token_ids(family: tuple[str, Path]) -> None:
    """Token by token, as the ingress detokenizes a stream: the parser's markers that are
    control tokens are kept in the text (others are skipped, as always), and the calls read
    out of it are the model's."""
    name, path = family
    parser = FAMILIES[name][2]
    tok = Tokenizer(path)
    fmt = TOOL_PARSERS[parser]
    ids = tok.encode(ANSWERS[parser], add_special_tokens=False) + tok.encode(
        "</s>", add_special_tokens=False)
    keep = tok.special_ids(fmt.markers + fmt.between)
    assert len(keep) == (0 if parser == "hermes" else 1)  # hermes' markers are plain text here
    detok, reader = tok.detokenizer([], keep), ToolCallReader(fmt)
    content, args, names = "", "", []
    for i in ids:
        out = reader.feed(detok.add([i]))
        content += out.content
        names += [d.name for d in out.calls if d.name]
        args += "".join(d.arguments for d in out.calls)
    out = reader.finish()
    assert (content + out.content, names, args) == (
        "Checking." if parser != "llama3_json" else "", ["get_weather"], '{"city": "Paris"}')
    # skipped as other control tokens are, Mistral's marker vanishes and the call with it
    _, calls = read_all(ToolCallReader(fmt), tok.decode(ids))
    assert bool(calls) == (parser != "mistral")
