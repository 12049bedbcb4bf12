"""Tool calls read out of a model's text as it streams, in the formats vLLM's tool-call
parsers read (`--tool-call-parser`), and the JSON array `tool_choice: required` constrains the
output to.

| parser        | what the model writes                                                 |
|---------------|-----------------------------------------------------------------------|
| `hermes`      | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated    |
|               | (Hermes, Qwen2.5)                                                      |
| `llama3_json` | `{"name": ..., "parameters": {...}}` as the whole answer, calls joined |
|               | by `;`, optionally after `<|python_tag|>` (Llama 3.1-3.3)               |
| `mistral`     | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral)         |

One reader serves streamed and whole answers: a whole answer is its text fed at once, so a
stream's deltas always reassemble to the non-streamed response. The reader holds back only
what is undecided (the start of a marker, whitespace that may precede a call, a call whose name
is not yet complete); content before, between and after calls is content.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

from prefixserve.cluster.call_scanner import CallScanner

_WHITESPACE = " \t\n\r"


def openai_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """Mistral's chat template refuses any id but nine letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its tool calls."""

    name: str
    markers: tuple[str, ...]  # text that opens calls inside content
    between: tuple[str, ...]  # text (besides whitespace) allowed between calls
    at_start: bool  # the answer may open with a call without a marker
    new_id: Callable[[], str] = openai_call_id


TOOL_PARSERS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), ("<tool_call>", "</tool_call>"), False),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>",), (";", "<|python_tag|>"),
                              True),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), ("[", ",", "]"), False,
                          mistral_call_id),
}
# `tool_choice: required`: the grammar makes the answer a JSON array of calls.
REQUIRED_FORMAT = ToolFormat("required", (), ("[", ",", "]"), True)


@dataclass
class ToolCallDelta:
    """New output of one tool call: its id and name come first, alone (as OpenAI streams
    them); then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ReaderOutput:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class _State(Enum):
    CONTENT = auto()
    BETWEEN = auto()  # after a marker or a call: more calls may follow
    IN_CALL = auto()


class ToolCallReader:
    """Splits one choice's text into content and tool calls (`feed` deltas, then `finish`)."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls  # calls past it are read and dropped (parallel_tool_calls)
        self.num_calls = 0
        self._state = _State.BETWEEN if fmt.at_start else _State.CONTENT
        self._buffer = ""  # text not yet decided
        self._held = ""  # trailing whitespace of the content: dropped if a call follows
        self._skipped = ""  # markers and separators since the last call or content
        self._region_called = False  # a call since the last content
        self._scanner: CallScanner | None = None
        self._sent_args = 0  # characters of the current call's arguments sent
        self._index: int | None = None  # the current call's index, once its name is sent

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> ReaderOutput:
        out = ReaderOutput()
        self._buffer += text
        while self._buffer and self._advance(out):
            pass
        return out

    def finish(self) -> ReaderOutput:
        """The end of the answer: what was held back is content unless it can be dropped."""
        out = ReaderOutput()
        if self._state is _State.IN_CALL and self._index is None:
            assert self._scanner is not None
            skipped = "" if self._region_called else self._skipped
            self._to_content(out, skipped + self._scanner.text + self._buffer)
        elif self._state is _State.BETWEEN and not self._region_called:
            self._to_content(out, self._skipped + self._buffer)
        elif self._state is _State.CONTENT:
            self._content(out, self._buffer)
        self._buffer = ""
        if not self.called:
            out.content += self._held
        self._held = ""
        return out

    # -- one decision at a time: each returns whether to go on with the buffer ----------------

    def _advance(self, out: ReaderOutput) -> bool:
        if self._state is _State.CONTENT:
            return self._read_content(out)
        if self._state is _State.BETWEEN:
            return self._read_between(out)
        return self._read_call(out)

    def _read_content(self, out: ReaderOutput) -> bool:
        found = [(i, m) for m in self.fmt.markers if (i := self._buffer.find(m)) >= 0]
        if found:
            i, marker = min(found)
            self._content(out, self._buffer[:i])
            self._skipped, self._held = self._held + marker, ""
            self._buffer = self._buffer[i + len(marker):]
            self._state, self._region_called = _State.BETWEEN, False
            return True
        keep = _partial_marker(self._buffer, self.fmt.markers)
        self._content(out, self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _read_between(self, out: ReaderOutput) -> bool:
        text = self._buffer.lstrip(_WHITESPACE)
        self._skipped += self._buffer[:len(self._buffer) - len(text)]
        self._buffer = text
        if not text:
            return False
        if text[0] == "{":
            self._scanner, self._sent_args, self._index = CallScanner(), 0, None
            self._state = _State.IN_CALL
            return True
        for piece in self.fmt.between:
            if text.startswith(piece):
                self._skipped += piece
                self._buffer = text[len(piece):]
                return True
        if _partial_marker(text, self.fmt.between) == len(text):
            return False  # may still become a separator
        if not self._region_called:  # markers but no call: they were content after all
            self._to_content(out, self._skipped)
        self._state = _State.CONTENT
        return True

    def _read_call(self, out: ReaderOutput) -> bool:
        scanner = self._scanner
        assert scanner is not None
        rest = scanner.feed(self._buffer)
        self._buffer = ""
        if scanner.name is not None and self._index is None:
            self._index = self._start_call(out, scanner.name)
        if self._index is not None:
            args = scanner.arguments()
            if args is None and scanner.done:
                args = "{}"  # a call without arguments
            if args is not None and self._index >= 0:
                self._send_args(out, args)
        if not (scanner.done or scanner.failed):
            return False
        if self._index is None:  # no name: not a call
            if not self._region_called:
                self._to_content(out, self._skipped)
            self._to_content(out, scanner.text)
            self._state = _State.CONTENT
        else:
            self._state, self._region_called = _State.BETWEEN, True
        self._skipped, self._scanner, self._buffer = "", None, rest
        return True

    # -- output -----------------------------------------------------------------------------

    def _start_call(self, out: ReaderOutput, name: str) -> int:
        """The call's index, its id and name sent; -1 for a call past `max_calls`."""
        self.num_calls += 1
        if self.max_calls is not None and self.num_calls > self.max_calls:
            return -1
        index = self.num_calls - 1
        out.calls.append(ToolCallDelta(index, self.fmt.new_id(), name))
        return index

    def _send_args(self, out: ReaderOutput, args: str) -> None:
        new = args[self._sent_args:]
        if new:
            self._sent_args = len(args)
            assert self._index is not None
            out.calls.append(ToolCallDelta(self._index, arguments=new))

    def _content(self, out: ReaderOutput, text: str) -> None:
        """Content; trailing whitespace is held until more content shows it is not the gap
        before a call."""
        text = self._held + text
        kept = text.rstrip(_WHITESPACE)
        out.content += kept
        self._held = text[len(kept):]

    def _to_content(self, out: ReaderOutput, text: str) -> None:
        if text:
            self._content(out, text)


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that a marker starts with (shorter than it)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


class NamedCallReader:
    """`tool_choice` naming a function: the whole answer is that function's arguments."""

    def __init__(self, name: str, new_id: Callable[[], str] = openai_call_id) -> None:
        self.name, self._new_id = name, new_id
        self.called = False

    def feed(self, text: str) -> ReaderOutput:
        out = ReaderOutput()
        if not self.called:
            self.called = True
            out.calls.append(ToolCallDelta(0, self._new_id(), self.name))
        if text:
            out.calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ReaderOutput:
        return self.feed("")


Reader = ToolCallReader | NamedCallReader


def read_all(reader: Reader, text: str) -> tuple[str, list[ToolCallDelta]]:
    """A whole answer's content and calls (each call whole: id, name, arguments)."""
    content, calls = "", {}  # type: tuple[str, dict[int, ToolCallDelta]]
    for part in (reader.feed(text), reader.finish()):
        content += part.content
        for d in part.calls:
            call = calls.setdefault(d.index, ToolCallDelta(d.index))
            call.id, call.name = call.id or d.id, call.name or d.name
            call.arguments += d.arguments
    return content, [calls[i] for i in sorted(calls)]
