"""Tool calls read out of model text (cluster/tool_parsers.py, cluster/call_scanner.py): each
parser's format, and a stream split anywhere reassembling to the whole answer's reading."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from prefixserve.cluster.call_scanner import CallScanner
from prefixserve.cluster.tool_parsers import (
    REQUIRED_FORMAT,
    TOOL_PARSERS,
    NamedCallReader,
    ToolCallReader,
    ToolFormat,
    read_all,
)

HERMES, LLAMA3, MISTRAL = (TOOL_PARSERS[n] for n in ("hermes", "llama3_json", "mistral"))
Calls = list[tuple[str, str]]


def whole(fmt: ToolFormat, text: str, max_calls: int | None = None) -> tuple[str, Calls]:
    content, calls = read_all(ToolCallReader(fmt, max_calls), text)
    return content, [(c.name or "", c.arguments) for c in calls]


def streamed(fmt: ToolFormat, pieces: list[str], max_calls: int | None = None
             ) -> tuple[str, Calls]:
    """Reassembled as a client does: content concatenated, calls by index (id and name once,
    in a delta of their own, before any argument text)."""
    reader = ToolCallReader(fmt, max_calls)
    content, calls = "", {}
    outs = [reader.feed(p) for p in pieces] + [reader.finish()]
    for out in outs:
        content += out.content
        for d in out.calls:
            if d.id is not None:
                assert d.index not in calls and d.name and d.arguments == ""
                calls[d.index] = [d.name, ""]
            else:
                assert d.name is None and d.arguments
                calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(n, a) for n, a in (calls[i] for i in range(len(calls)))]


def splits(text: str, seed: int) -> list[list[str]]:
    """The text one character at a time, in pairs, and cut at random places."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [list(text), [text[i:i + 2] for i in range(0, len(text), 2)],
            [text[a:b] for a, b in itertools.pairwise(bounds)]]


CASES = [
    # (format, model text, content, calls)
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Paris"}}\n</tool_call>', "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"s": "} \\" {"}}\n</tool_call>\n'
             '<tool_call>\n{"arguments": {"x": [1, {"y": 2}]}, "name": "b"}\n</tool_call>\n',
     "", [("a", '{"s": "} \\" {"}'), ("b", '{"x": [1, {"y": 2}]}')]),
    (HERMES, "No tools needed: 2 < 3 and <b>bold</b>.  ", "No tools needed: 2 < 3 and "
             "<b>bold</b>.  ", []),
    (HERMES, "<tool_call> then prose", "<tool_call> then prose", []),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}'
             '</tool_call>', []),
    (HERMES, '<tool_call>{"name": "f"}</tool_call> and done', "and done", [("f", "{}")]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"q": "to be cont', "",
     [("f", '{"q": "to be cont')]),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', "",
     [("f", '{"q": 1}')]),
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", '{"x": 1}'), ("g", "{}")]),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"x": -1.5e3}}', "",
     [("f", '{"x": -1.5e3}')]),
    (LLAMA3, '  {"city": "Paris", "temp": 21}', '  {"city": "Paris", "temp": 21}', []),
    (LLAMA3, "The answer is {\"name\": \"f\"}.", 'The answer is {"name": "f"}.', []),
    (MISTRAL, 'Sure.[TOOL_CALLS] [{"name": "f", "arguments": {"a": "b"}}, {"name": "g", '
              '"arguments": {"n": null}}]', "Sure.", [("f", '{"a": "b"}'), ("g", '{"n": null}')]),
    (MISTRAL, "Plain [TOOL text] with brackets [1, 2].", "Plain [TOOL text] with brackets "
              "[1, 2].", []),
    (REQUIRED_FORMAT, '[{"name": "f", "parameters": {"a": true}}, {"name": "g", "parameters": '
                      '{"b": [false]}}]', "", [("f", '{"a": true}'), ("g", '{"b": [false]}')]),
    # cut off before a call's name: what was held back is content after all
    (HERMES, 'Hi <tool_call>{"na', 'Hi <tool_call>{"na', []),
    (HERMES, "Hi <tool_call>", "Hi <tool_call>", []),
    (HERMES, '<tool_call>{"name": "f"}</tool_call><tool_call>{"arg', '{"arg', [("f", "{}")]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> \n<tool_call> x', "x",
     [("f", '{"a": 1}')]),
    (LLAMA3, "  ", "  ", []),
    (HERMES, "Hi <tool_", "Hi <tool_", []),  # a marker's start, never finished: content
    (HERMES, '<tool_call>{"name": "f"}</tool_call></tool_', "", [("f", "{}")]),
    (MISTRAL, "[TOOL_CALLS] [x", "[TOOL_CALLS] [x", []),
    # only ASCII whitespace is the gap before or after a call; other spaces are content
    (HERMES, 'Hi\u00a0<tool_call>{"name": "f"}</tool_call>', "Hi\u00a0", [("f", "{}")]),
    (HERMES, '<tool_call>{"name": "f"}</tool_call>\u00a0', "\u00a0", [("f", "{}")]),
    # literals before and after the name and the arguments
    (LLAMA3, '{"id": 7, "name": "f", "parameters": {"x": 1}, "n": -2 }', "", [("f", '{"x": 1}')]),
    (LLAMA3, '{"name": "f", "parameters": 1.5 }', "", [("f", "1.5")]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_reads_each_format(fmt: ToolFormat, text: str, content: str, calls: Calls) -> None:
    assert whole(fmt, text) == (content, calls)
    for call in calls:
        if not call[1].endswith("cont"):  # the truncated one
            json.loads(call[1])


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_a_stream_split_anywhere_reads_as_the_whole(fmt: ToolFormat, text: str, content: str,
                                                    calls: Calls) -> None:
    for seed, pieces in enumerate(splits(text, seed=len(text))):
        assert streamed(fmt, pieces) == (content, calls), (seed, pieces)


def test_arguments_stream_as_they_arrive() -> None:
    """The name goes out once complete, then each piece of the arguments as it comes; the
    held-back parts are only what is undecided."""
    reader = ToolCallReader(HERMES)
    assert reader.feed("Hi ").content == "Hi"  # the space may be the gap before a call
    out = reader.feed("<tool_")
    assert (out.content, out.calls) == ("", [])  # a marker may be starting
    out = reader.feed('call>{"name": "get_we')
    assert out.calls == []  # the name is not complete
    out = reader.feed('ather", "arguments": {"ci')
    assert [(d.index, d.name, d.arguments) for d in out.calls] == [
        (0, "get_weather", ""), (0, None, '{"ci')]
    out = reader.feed('ty": "Paris"}}</tool_call>')
    assert [(d.name, d.arguments) for d in out.calls] == [(None, 'ty": "Paris"}')]
    assert reader.finish().content == ""  # the space before the call is dropped
    # a marker followed by what cannot be a call is content at once, not at the next delta
    assert ToolCallReader(HERMES).feed("<tool_call> x").content == "<tool_call> x"


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]'
    assert whole(REQUIRED_FORMAT, text, max_calls=1) == ("", [("f", "{}")])
    assert streamed(REQUIRED_FORMAT, list(text), max_calls=1) == ("", [("f", "{}")])


def test_call_ids() -> None:
    _, calls = read_all(ToolCallReader(MISTRAL), '[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id or "")  # Mistral's template needs this
    _, calls = read_all(ToolCallReader(HERMES), '<tool_call>{"name": "f"}</tool_call>' * 2)
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id or "") for c in calls)
    assert calls[0].id != calls[1].id


def test_named_function_reads_the_whole_answer_as_arguments() -> None:
    content, calls = read_all(NamedCallReader("f"), '{"a": 1}')
    assert (content, [(c.index, c.name, c.arguments) for c in calls]) == (
        "", [(0, "f", '{"a": 1}')])
    assert (calls[0].id or "").startswith("chatcmpl-tool-")
    reader = NamedCallReader("f")
    first, second, end = reader.feed('{"a"'), reader.feed(": 1}"), reader.finish()
    assert [(d.name, d.arguments) for d in first.calls] == [("f", ""), (None, '{"a"')]
    assert [(d.name, d.arguments) for d in second.calls] == [(None, ": 1}")]
    assert end.calls == [] and reader.called


def test_scanner_reads_a_call_object() -> None:
    scanner = CallScanner()
    assert scanner.feed('{"name": "f\\u00e9", "arguments": {"k": "v\\\\"}} tail') == " tail"
    assert (scanner.done, scanner.name, scanner.arguments()) == (True, "fé", '{"k": "v\\\\"}')
    for bad in ('{"name" 1}', '["name"]', '{"name": "f",, }', '{"\\x": 1}', "x", "{x",
                '{"name": "f" "x"}'):
        scanner = CallScanner()
        scanner.feed(bad)
        assert scanner.failed, bad
    scanner = CallScanner()
    assert scanner.feed('{"name": 5, "parameters": 7}') == ""
    assert (scanner.done, scanner.name, scanner.arguments()) == (True, None, "7")
    scanner = CallScanner()
    scanner.feed('{"name": "bad \\x", "arguments": {}}')
    assert scanner.done and scanner.name is None  # a name that is no string is no name
    scanner = CallScanner()
    assert scanner.feed("{}]") == "]"
    assert (scanner.done, scanner.name, scanner.arguments()) == (True, None, None)
    scanner = CallScanner()
    scanner.feed('{"name": "f", "arguments": "bad \\x"}')
    assert scanner.done and scanner.arguments() is None  # a quoted value that is no string
    scanner = CallScanner()
    assert scanner.feed('{"name": "f", "arguments": "{\\"a\\"') == ""  # still open
    assert scanner.arguments() is None  # quoted: held until complete
    assert scanner.feed(': 1}"}') == ""
    assert scanner.arguments() == '{"a": 1}'
