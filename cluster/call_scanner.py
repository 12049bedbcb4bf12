"""One tool call's JSON object, read as it arrives: its name once the name's string is
complete, and the raw text of its arguments so far.

A model writes a call as `{"name": "get_weather", "arguments": {"city": "Paris"}}` (the
arguments key is `parameters` in Llama's format). Streaming needs the name before any argument
and the arguments as fragments; reading the object one character at a time, each character
once, gives both in time linear in the call's length however the text is chunked, and the
same answer for the whole text as for any split of it.
"""

from __future__ import annotations

import json
import re
from enum import Enum, auto

NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"
_STRING_SPECIAL = re.compile(r'["\\]')  # what ends or escapes inside a JSON string
_NESTED_SPECIAL = re.compile(r'[{}\[\]"\\]')  # what changes depth or string state
_INVALID = object()


def _loads(text: str) -> object:
    """A complete JSON string's value; _INVALID for a bad escape."""
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


class _State(Enum):
    OPEN = auto()  # before the object's `{`
    KEY = auto()  # before a key (or the closing `}`)
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()  # before a value
    IN_STRING = auto()  # a string value
    IN_NESTED = auto()  # an object or array value
    IN_LITERAL = auto()  # a number, true, false or null
    AFTER_VALUE = auto()  # before `,` or `}`
    DONE = auto()  # the object closed
    ERROR = auto()  # not a JSON object


class CallScanner:
    """Feed text with `feed`; the object's reading so far is in `name`, `arguments()`,
    `done` and `failed`."""

    def __init__(self) -> None:
        self.text = ""  # the object's text so far (nothing past its closing brace)
        self.name: str | None = None  # the name key's string, once complete
        self._state = _State.OPEN
        self._pos = 0
        self._start = 0  # where the current key or value began
        self._key: str | None = None
        self._depth = 0  # nesting inside an object or array value
        self._in_string = False  # inside a string within a nested value
        self._args: tuple[int, int | None, bool] | None = None  # start, end, is a string

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        return self._state is _State.ERROR

    def feed(self, chunk: str) -> str:
        """Read `chunk`; return what follows the object's end (empty while it is open)."""
        self.text += chunk
        while self._pos < len(self.text) and self._state not in (_State.DONE, _State.ERROR):
            self._step()
        rest = self.text[self._pos:]
        if self._state in (_State.DONE, _State.ERROR):
            self.text = self.text[:self._pos]
            return rest
        return ""

    def arguments(self) -> str | None:
        """The arguments' text so far: an object's raw text as it grows; a string value (some
        models quote the arguments) only once complete, decoded; None before the key."""
        if self._args is None:
            return None
        start, end, quoted = self._args
        if not quoted:
            return self.text[start:self._pos if end is None else end]
        if end is None:
            return None
        value = _loads(self.text[start:end])
        return value if isinstance(value, str) else None

    # -- the state machine ------------------------------------------------------------------

    def _step(self) -> None:
        text, i, state = self.text, self._pos, self._state
        c = text[i]
        if state in (_State.IN_STRING, _State.IN_KEY):
            m = _STRING_SPECIAL.search(text, i)
            if m is None:
                self._pos = len(text)
            elif m.group() == "\\":
                self._pos = m.end() + 1  # the escaped character may still be to come
            else:
                self._pos = m.end()
                self._end_string(state)
            return
        if state is _State.IN_NESTED:
            self._step_nested()
            return
        self._pos = i + 1
        if state is _State.IN_LITERAL:
            if c in _WHITESPACE or c in ",}":
                self._pos = i  # the delimiter is read again, after the value
                self._end_value(i)
            return
        if c in _WHITESPACE:
            return
        if state is _State.OPEN:
            self._state = _State.KEY if c == "{" else _State.ERROR
        elif state is _State.KEY:
            if c == '"':
                self._start, self._state = i, _State.IN_KEY
            else:
                self._state = _State.DONE if c == "}" else _State.ERROR
        elif state is _State.COLON:
            self._state = _State.VALUE if c == ":" else _State.ERROR
        elif state is _State.VALUE:
            self._start_value(i, c)
        elif state is _State.AFTER_VALUE:
            self._state = {",": _State.KEY, "}": _State.DONE}.get(c, _State.ERROR)

    def _end_string(self, state: _State) -> None:
        if state is _State.IN_KEY:
            key = _loads(self.text[self._start:self._pos])
            self._key = key if isinstance(key, str) else None
            self._state = _State.COLON if isinstance(key, str) else _State.ERROR
        else:
            self._end_value(self._pos)

    def _start_value(self, i: int, c: str) -> None:
        self._start = i
        if self._key in ARGUMENT_KEYS and self._args is None:
            self._args = (i, None, c == '"')
        if c == '"':
            self._state = _State.IN_STRING
        elif c in "{[":
            self._state, self._depth, self._in_string = _State.IN_NESTED, 1, False
        else:
            self._state = _State.IN_LITERAL

    def _step_nested(self) -> None:
        pattern = _STRING_SPECIAL if self._in_string else _NESTED_SPECIAL
        m = pattern.search(self.text, self._pos)
        if m is None:
            self._pos = len(self.text)
            return
        c, self._pos = m.group(), m.end()
        if c == "\\":
            self._pos += 1
        elif c == '"':
            self._in_string = not self._in_string
        elif c in "{[":
            self._depth += 1
        else:
            self._depth -= 1
            if self._depth == 0:
                self._end_value(self._pos)

    def _end_value(self, end: int) -> None:
        self._state = _State.AFTER_VALUE
        if self._args is not None and self._args[0] == self._start and self._args[1] is None:
            self._args = (self._start, end, self._args[2])
        if self._key == NAME_KEY and self.name is None and self.text[self._start] == '"':
            value = _loads(self.text[self._start:end])
            self.name = value if isinstance(value, str) else None
