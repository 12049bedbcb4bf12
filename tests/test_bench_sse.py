"""SSE parsing: keep-alives, role-only and usage-only chunks, errors, [DONE], split lines; and
how the soak classifies a stream by its events."""

from __future__ import annotations

import asyncio
import json

import httpx

from prefixserve.bench.load.soak import CLEAN_ERROR, FAILED, OK, Outcome, Spec, classify_stream
from prefixserve.bench.load.sse import SSEParser, chunk_text, decode

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
HELLO = {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}


def _stream(*events: object) -> bytes:
    out = b": ping\n\n"
    for e in events:
        data = e if isinstance(e, str) else json.dumps(e)
        out += f"data: {data}\n\n".encode()
    return out


def _feed_all(parser: SSEParser, chunks: list[bytes]) -> list[str]:
    got: list[str] = []
    for c in chunks:
        got += parser.feed(c)
    return got + parser.close()


def test_full_stream_in_one_chunk() -> None:
    payloads = SSEParser().feed(_stream(ROLE, HELLO, USAGE, "[DONE]"))
    events = [decode(p) for p in payloads]
    assert [e.data for e in events[:3]] == [ROLE, HELLO, USAGE]
    assert events[3].done and events[3].data is None
    assert chunk_text(ROLE) == ""                 # role-only: not content
    assert chunk_text(HELLO) == "Hel"
    assert chunk_text(USAGE) == ""                # usage-only: empty choices


def test_split_at_every_byte_gives_the_same_events() -> None:
    raw = _stream(ROLE, {"choices": [{"text": "é ü"}]}, USAGE, "[DONE]")
    whole = SSEParser().feed(raw)
    bytewise = _feed_all(SSEParser(), [raw[i:i + 1] for i in range(len(raw))])
    assert bytewise == whole
    assert len(whole) == 4
    assert chunk_text(json.loads(whole[1])) == "é ü"   # multi-byte chars split across chunks


def test_crlf_and_keepalive_comments_between_events() -> None:
    raw = b": ping\r\n\r\ndata: {\"a\": 1}\r\n\r\n: keep-alive\r\n\r\ndata: [DONE]\r\n\r\n"
    halves = [raw[:17], raw[17:18], raw[18:]]     # cut between CR and LF
    assert _feed_all(SSEParser(), halves) == ['{"a": 1}', "[DONE]"]


def test_multiline_data_and_other_fields() -> None:
    raw = b"event: message\nid: 7\ndata: {\"x\":\ndata: 2}\nretry: 10\n\n"
    (payload,) = SSEParser().feed(raw)
    assert json.loads(payload) == {"x": 2}


def test_error_event() -> None:
    err = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    (payload,) = SSEParser().feed(_stream(err))
    event = decode(payload)
    assert event.error == "prompt too long"
    assert not event.done
    assert decode('{"error": "boom"}').error == "boom"
    assert decode("not json").error is not None
    assert decode(json.dumps(HELLO)).error is None


def test_unterminated_last_event_is_flushed_on_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]


def _soak_outcome(body: bytes, n: int = 1) -> Outcome:
    response = httpx.Response(200, content=body)
    return asyncio.run(classify_stream(response, Spec([1], 4, stream=True, n=n), 0.0, "w"))


def test_soak_reads_a_stream_whose_text_holds_unicode_line_breaks() -> None:
    text = {"choices": [{"index": 0, "text": "a\u2028b\x85", "finish_reason": "length"}]}
    raw = f"data: {json.dumps(text, ensure_ascii=False)}\n\ndata: [DONE]\n\n".encode()
    assert _soak_outcome(raw).kind == OK
    assert _soak_outcome(raw, n=2).detail == "[DONE] after 1/2 finished choices"


def test_soak_classifies_a_malformed_event_and_an_error_event() -> None:
    malformed = _soak_outcome(b'data: {"choices": [\n\ndata: [DONE]\n\n')
    assert (malformed.kind, malformed.detail) == (FAILED, "malformed event: '{\"choices\": ['")
    error = _soak_outcome(_stream({"error": {"message": "boom"}}, "[DONE]"))
    assert (error.kind, error.detail) == (CLEAN_ERROR, '{"message": "boom"}')
    assert _soak_outcome(_stream(HELLO)).detail == "stream ended without [DONE]"
