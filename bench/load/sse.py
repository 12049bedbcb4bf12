"""Server-sent events, parsed incrementally from raw network chunks.

A network chunk may end mid-line (or mid UTF-8 character), so bytes are buffered until a full
line arrives. Comment lines (`: ping`, keep-alives) carry no data and are dropped. An event ends at
a blank line; its `data:` lines are joined with newlines, as the SSE spec says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"


@dataclass
class StreamEvent:
    """One decoded `data:` payload: a JSON chunk, the `[DONE]` sentinel, or an error."""

    data: dict[str, Any] | None      # None for [DONE]
    done: bool = False

    @property
    def error(self) -> str | None:
        """The error message when the server streamed `data: {"error": ...}`."""
        if self.data is None or "error" not in self.data:
            return None
        err = self.data["error"]
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)


class SSEParser:
    """Feed raw bytes; get back the data payloads of every event completed so far."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        payloads: list[str] = []
        while True:
            cut = self._next_line_end()
            if cut is None:
                return payloads
            end, skip = cut
            line = self._buf[:end].decode("utf-8")
            self._buf = self._buf[end + skip:]
            payload = self._line(line)
            if payload is not None:
                payloads.append(payload)

    def close(self) -> list[str]:
        """Flush an event the server did not terminate with a blank line."""
        payloads = self.feed(b"\n") if self._buf else []
        if self._data:
            payloads.append("\n".join(self._data))
            self._data = []
        return payloads

    def _next_line_end(self) -> tuple[int, int] | None:
        """Position and width of the first line terminator (CRLF, LF or CR)."""
        lf, cr = self._buf.find(b"\n"), self._buf.find(b"\r")
        if cr == -1 and lf == -1:
            return None
        if cr == -1 or (lf != -1 and lf < cr):
            return lf, 1
        if cr + 1 == len(self._buf):
            return None            # a CR at the end may be the first half of CRLF: wait
        return cr, 2 if self._buf[cr + 1:cr + 2] == b"\n" else 1

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            payload, self._data = "\n".join(self._data), []
            return payload
        if line.startswith(":"):
            return None            # comment / keep-alive
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None                # event:, id:, retry: carry nothing we measure


def decode(payload: str) -> StreamEvent:
    """Turn one data payload into a StreamEvent; non-JSON payloads become errors."""
    if payload.strip() == DONE:
        return StreamEvent(None, done=True)
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return StreamEvent({"error": f"unparseable event: {payload[:200]!r}"})
    if not isinstance(data, dict):
        return StreamEvent({"error": f"unexpected event: {payload[:200]!r}"})
    return StreamEvent(data)


def chunk_text(data: dict[str, Any]) -> str:
    """The generated text a chunk carries (completions `text` or chat `delta.content`)."""
    parts: list[str] = []
    for choice in data.get("choices") or []:
        if "text" in choice:
            parts.append(choice.get("text") or "")
        delta = choice.get("delta") or {}
        parts.append(delta.get("content") or "")
        parts.append(delta.get("reasoning_content") or "")
    return "".join(parts)


@dataclass
class StreamReader:
    """What a completion stream has said so far, fed network chunks as they arrive.

    The async client and the Locust user share it, so both stamp content events alike.
    """

    content_times: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    parser: SSEParser = field(default_factory=SSEParser)

    def feed(self, chunk: bytes, now: float) -> bool:
        """Absorb one chunk received at `now`; True once the stream ended ([DONE] or error)."""
        return any(self._absorb(payload, now) for payload in self.parser.feed(chunk))

    def finish(self) -> str:
        """The error of a stream that closed without [DONE] ('' if it said enough)."""
        for payload in self.parser.close():
            event = decode(payload)
            if event.error is not None:
                self.error = event.error
        if not self.error and not (self.usage or self.content_times):
            self.error = "stream ended without data"
        return self.error

    def _absorb(self, payload: str, now: float) -> bool:
        event = decode(payload)
        if event.done:
            return True
        if event.error is not None:
            self.error = event.error
            return True
        data = event.data or {}
        if data.get("usage"):
            self.usage.update(data["usage"])
        if chunk_text(data):
            self.content_times.append(now)
        return False
