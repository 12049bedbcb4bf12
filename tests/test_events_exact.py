"""The event op stream and the load record, exactly: byte layouts, defaults, every rejection."""

from __future__ import annotations

import math

import msgpack
import pytest

from prefixserve.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    WorkerLoad,
    decode_load,
    encode_events,
    encode_load,
    pack_digests,
)

H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, bytes(range(16))


def load_payload(**fields: object) -> bytes:
    return msgpack.packb({"type": "load", **fields}, use_bin_type=True)


def test_op_stream_bytes() -> None:
    events = [BlockStored((H1, H2)), AllBlocksCleared(), BlockRemoved((H3,)), BlockStored(())]
    assert encode_events(events) == (
        b"S\x00\x00\x00\x02" + H1 + H2
        + b"C\x00\x00\x00\x00"
        + b"R\x00\x00\x00\x01" + H3
        + b"S\x00\x00\x00\x00"
    )
    assert encode_events([]) == b""


def test_op_stream_rejects_non_events_by_name() -> None:
    with pytest.raises(TypeError) as info:
        encode_events([BlockStored((H1,)), "stored"])  # type: ignore[list-item]
    assert str(info.value) == "not a KV event: 'stored'"


@pytest.mark.parametrize("digests", [[H1[:15]], [H1, H2 + b"\x00"], [H1 + H2[:8], H2[8:]]])
def test_pack_digests_message(digests: list[bytes]) -> None:
    with pytest.raises(ValueError) as info:
        pack_digests(digests)
    assert str(info.value) == "block digests must be 16 bytes each"


def test_load_round_trip_is_exact_and_typed() -> None:
    load = WorkerLoad(num_running=3, num_waiting=1, queued_prefill_tokens=640, kv_usage=0.25,
                      prefill_tokens_per_s=4100.5, decode_tokens_per_s=900.0, timestamp=12.5,
                      kv_empty_blocks=77, busy_share=0.375, kv_total_blocks=900,
                      host_load_tokens_per_s=250000.0, disk_load_tokens_per_s=18000.5)
    assert decode_load(encode_load(load)) == load
    assert type(decode_load(encode_load(load)).kv_empty_blocks) is int
    assert type(decode_load(encode_load(load)).kv_total_blocks) is int
    assert msgpack.unpackb(encode_load(load)) == {
        "type": "load", "num_running": 3, "num_waiting": 1, "queued_prefill_tokens": 640,
        "kv_usage": 0.25, "prefill_tokens_per_s": 4100.5, "decode_tokens_per_s": 900.0,
        "timestamp": 12.5, "kv_empty_blocks": 77, "busy_share": 0.375,
        "kv_total_blocks": 900, "host_load_tokens_per_s": 250000.0,
        "disk_load_tokens_per_s": 18000.5,
    }


def test_decode_load_defaults_missing_fields_to_zero_and_coerces_types() -> None:
    got = decode_load(load_payload(num_running=2.0, kv_usage=1))
    assert got == WorkerLoad(num_running=2, kv_usage=1.0)
    assert type(got.num_running) is int and type(got.num_waiting) is int
    assert type(got.kv_usage) is float and type(got.timestamp) is float
    assert decode_load(load_payload()) == WorkerLoad()


def test_decode_load_accepts_zero_and_rejects_inf_nan_negative() -> None:
    assert decode_load(load_payload(num_running=0, kv_usage=0.0)) == WorkerLoad()
    for bad in (math.inf, math.nan, -1, -0.5, True, "3", None):
        with pytest.raises(EventDecodeError) as info:
            decode_load(load_payload(num_waiting=bad))
        assert str(info.value) == "load field 'num_waiting' must be a finite non-negative number"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not bytes", "payload must be bytes"),
        (msgpack.packb([1, 2]), "expected a map with type 'load'"),
        (msgpack.packb({"type": "stored"}), "expected a map with type 'load'"),
        (msgpack.packb({"num_running": 1}), "expected a map with type 'load'"),
    ],
)
def test_decode_load_rejects_what_is_not_a_load_map(payload: object, message: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_load(payload)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_decode_load_rejects_malformed_msgpack_and_non_string_keys() -> None:
    with pytest.raises(EventDecodeError, match=r"^malformed msgpack: ") as info:
        decode_load(b"\xc1")  # a never-used msgpack type byte
    assert info.value.__suppress_context__
    non_string_key = msgpack.packb({"type": "load", 1: 2}, strict_types=False)
    with pytest.raises(EventDecodeError, match=r"^malformed msgpack: "):
        decode_load(non_string_key)
    assert decode_load(bytearray(load_payload(num_running=4))) == WorkerLoad(num_running=4)
    assert decode_load(memoryview(load_payload())) == WorkerLoad()
