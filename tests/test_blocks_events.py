"""The block-hash chain and the KV event wire format: the contract between workers and routers."""

from __future__ import annotations

import re

import msgpack
import pytest

from prefixserve.router.blocks import (
    ROOT,
    BlockHasher,
    ChainMemo,
    hash_block,
    hash_chain,
    namespace,
    token_array,
)
from prefixserve.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    WorkerLoad,
    decode_events,
    decode_load,
    encode_events,
    encode_load,
    pack_digests,
)

NS = namespace("tiny-llama")


def test_pinned_digests() -> None:
    # An accidental change to the layout breaks routing across versions: fail loudly.
    assert ROOT.hex() == "b710b170f17bc6bbe7409fb5b566e01c"
    assert NS.hex() == "473522c1957565684ad9b7a7516ec4e2"
    assert namespace("tiny-llama", "tenant-a").hex() == "2a0c72c40d76f42345273d4ae9f6a635"
    assert [h.hex() for h in hash_chain(list(range(40)), 16, NS)] == [
        "ce3597f4b95dfe59b236a1e400c8fe0a",
        "f9950800ea96f3bbac990e22f64db51e",
    ]


def test_only_full_blocks_and_prefix_property() -> None:
    assert hash_chain(list(range(15)), 16, NS) == []
    a = hash_chain(list(range(64)), 16, NS)
    b = hash_chain(list(range(48)) + [9, 9, 9, 9] * 4, 16, NS)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert all(len(h) == 16 for h in a)


def test_namespace_isolates_salt_and_model() -> None:
    tokens = list(range(32))
    plain = hash_chain(tokens, 16, namespace("m"))
    salted = hash_chain(tokens, 16, namespace("m", "t1"))
    other = hash_chain(tokens, 16, namespace("m", "t2"))
    other_model = hash_chain(tokens, 16, namespace("m2"))
    assert len({plain[0], salted[0], other[0], other_model[0]}) == 4
    # An empty salt is still a salt: it must not collide with "no salt".
    assert hash_chain(tokens, 16, namespace("m", ""))[0] != plain[0]


def test_incremental_equals_one_shot() -> None:
    tokens = list(range(100))
    hasher = BlockHasher(16, NS)
    got = []
    for i in range(0, 100, 7):
        got += hasher.append(tokens[i : i + 7])
    assert got == hasher.hashes == hash_chain(tokens, 16, NS)
    assert hasher.num_tokens == 100


def test_token_arrays_hash_as_their_ids() -> None:
    ids = [0, 1, 2**32 - 1, *range(50_000, 50_077)]
    packed = token_array(ids)
    assert list(packed) == ids and packed.itemsize == 4
    assert token_array(packed) == packed and token_array(packed) is not packed
    assert hash_chain(packed, 16, NS) == hash_chain(ids, 16, NS)
    assert ChainMemo(16).chain(packed, NS) == hash_chain(ids, 16, NS)
    for bad in ([2**32], [-1], [1.5]):
        with pytest.raises(ValueError, match="token ids"):
            token_array(bad)


def test_layout_is_not_string_joining() -> None:
    # [1, 23] and [12, 3] join to the same string; the binary layout keeps them apart.
    assert hash_block(ROOT, [1, 23]) != hash_block(ROOT, [12, 3])
    with pytest.raises(ValueError):
        hash_block(ROOT, [-1])
    with pytest.raises(ValueError):
        hash_block(b"short", [1])


def test_event_op_stream_layout() -> None:
    # The index's apply script parses exactly this: op | u32 BE count | count x 16-byte digest.
    h = hash_chain(list(range(48)), 16, NS)
    events = (BlockStored((h[0], h[1])), BlockRemoved((h[2],)), AllBlocksCleared())
    assert encode_events(events) == (
        b"S\x00\x00\x00\x02" + h[0] + h[1] + b"R\x00\x00\x00\x01" + h[2] + b"C\x00\x00\x00\x00"
    )
    assert encode_events([]) == b""
    assert encode_events([BlockStored(())]) == b"S\x00\x00\x00\x00"
    many = tuple(hash_chain(list(range(16 * 300)), 16, NS))
    assert encode_events([BlockRemoved(many)])[:5] == b"R\x00\x00\x01\x2c"  # 300


def test_an_op_stream_decodes_to_its_events() -> None:
    h = hash_chain(list(range(16 * 40)), 16, NS)
    events = [BlockStored(tuple(h[:30])), AllBlocksCleared(), BlockRemoved((h[3], h[1])),
              BlockStored(()), BlockStored((h[39],)), BlockStored((h[31], h[32]), "host"),
              BlockStored((h[33],), "disk")]
    assert decode_events(encode_events(events)) == events
    # the medium is the op: H host memory, D disk (S is the device pool)
    assert encode_events([BlockStored((h[0],), "host")])[:1] == b"H"
    assert encode_events([BlockStored((h[0],), "disk")])[:1] == b"D"
    assert decode_events(b"") == []


@pytest.mark.parametrize(("ops", "says"), [
    (b"S\x00\x00\x00\x02" + b"x" * 31, "2 digests need 37 bytes"),  # one byte short
    (b"S\x00\x00", "in the header at byte 0"),
    (b"R\x00\x00\x00\x00S", "in the header at byte 5"),
    (b"S\x01\x00\x00\x00" + b"x" * 32, "16777216 digests need"),  # a count past 3 bytes
    (b"X\x00\x00\x00\x00", "unknown op b'X' with 0 digests"),
    (b"C\x00\x00\x00\x01" + b"x" * 16, "unknown op b'C' with 1 digests"),  # clears no block
])
def test_a_malformed_op_stream_is_refused(ops: bytes, says: str) -> None:
    with pytest.raises(EventDecodeError, match=re.escape(says)):
        decode_events(ops)


@pytest.mark.parametrize("hashes", [(b"short",), (b"x" * 15, b"y" * 17), (b"",), (b"z" * 17,)])
def test_op_stream_rejects_digests_of_the_wrong_length(hashes: tuple[bytes, ...]) -> None:
    with pytest.raises(ValueError):
        encode_events([BlockStored(hashes)])
    with pytest.raises(ValueError):
        pack_digests(hashes)


def test_op_stream_rejects_what_is_not_an_event() -> None:
    with pytest.raises(TypeError):
        encode_events([("stored", b"x" * 16)])


def test_pack_digests_concatenates_in_order() -> None:
    h = hash_chain(list(range(48)), 16, NS)
    assert pack_digests(h) == h[0] + h[1] + h[2]
    assert pack_digests([]) == b""


def test_load_round_trip_and_validation() -> None:
    load = WorkerLoad(num_running=2, num_waiting=1, queued_prefill_tokens=300, kv_usage=0.5,
                      prefill_tokens_per_s=1000.0, decode_tokens_per_s=50.0, timestamp=1.0)
    assert decode_load(encode_load(load)) == load
    with pytest.raises(EventDecodeError):
        decode_load(msgpack.packb({"type": "load", "num_running": "many"}))
    with pytest.raises(EventDecodeError):
        decode_load(msgpack.packb({"type": "load", "kv_usage": -1}))
