"""One block's file in the disk tier (workers/kv_tiers/disk_format.py): the layout key, the
header and each way a file fails its checks, with the reason counted for it."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from prefixserve.workers.kv_tiers import disk_format
from prefixserve.workers.kv_tiers.base import LoadFailed
from prefixserve.workers.kv_tiers.disk_format import (
    HEADER,
    MAGIC,
    SUFFIX,
    check_header,
    file_name,
    hash_of,
    layout_key,
    read_block,
    write_block,
)
from prefixserve.workers.kv_tiers.host import HostTier

KEY, LAYOUT = layout_key("fp", 16, "float32", (2, 2, 16, 1, 4))
H = bytes(range(16))
PAYLOAD = bytes(range(256)) * 2


def test_the_layout_key_names_every_input() -> None:
    assert len(KEY) == 16
    assert LAYOUT == {"model_fingerprint": "fp", "block_size": 16, "dtype": "float32",
                      "block_shape": [2, 2, 16, 1, 4], "format": "PSKV1"}
    others = [layout_key("fq", 16, "float32", (2, 2, 16, 1, 4)),
              layout_key("fp", 32, "float32", (2, 2, 16, 1, 4)),
              layout_key("fp", 16, "bfloat16", (2, 2, 16, 1, 4)),
              layout_key("fp", 16, "float32", (2, 2, 16, 2, 2))]
    assert len({KEY, *(k for k, _ in others)}) == 5
    assert layout_key("fp", 16, "float32", (2, 2, 16, 1, 4))[0] == KEY  # stable


def test_file_names_round_trip_and_anything_else_is_no_block() -> None:
    assert file_name(H) == H.hex() + ".kv" and SUFFIX == ".kv"
    assert hash_of(file_name(H)) == H
    assert hash_of(H.hex() + ".tmp") is None and hash_of("zz" * 16 + ".kv") is None
    assert hash_of(".lock") is None


def test_a_written_block_reads_back_whole(tmp_path: Path) -> None:
    size = write_block(tmp_path, KEY, H, memoryview(PAYLOAD))
    path = tmp_path / file_name(H)
    assert size == HEADER.size + len(PAYLOAD) == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    raw = path.read_bytes()
    assert HEADER.unpack_from(raw) == (MAGIC, KEY, H, len(PAYLOAD), zlib.crc32(PAYLOAD))
    assert check_header(raw[: HEADER.size], KEY, H, size) == len(PAYLOAD)
    assert check_header(raw[: HEADER.size], KEY, None, size) == len(PAYLOAD)
    assert read_block(path, KEY, H, len(PAYLOAD)) == PAYLOAD


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(OSError):
        write_block(tmp_path / "gone", KEY, H, memoryview(PAYLOAD))

    def full(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", full)  # written, then the rename fails
    with pytest.raises(OSError, match="No space"):
        write_block(tmp_path, KEY, H, memoryview(PAYLOAD))
    assert list(tmp_path.iterdir()) == []  # the temporary file went too
    monkeypatch.setattr(disk_format, "open", lambda *a: full(*a), raising=False)
    with pytest.raises(OSError) as failed:  # the disk is full before the file exists
        write_block(tmp_path, KEY, H, memoryview(PAYLOAD))
    assert failed.value.errno == 28  # the write's own error, not the cleanup's missing file
    assert list(tmp_path.iterdir()) == []


def header(magic: bytes = MAGIC, key: bytes = KEY, h: bytes = H, n: int = len(PAYLOAD),
           crc: int | None = None) -> bytes:
    return HEADER.pack(magic, key, h, n, zlib.crc32(PAYLOAD) if crc is None else crc)


@pytest.mark.parametrize(("raw", "size", "reason", "says"), [
    (header()[:-1], HEADER.size + len(PAYLOAD), "truncated", f"{HEADER.size - 1}-byte header"),
    (header(magic=b"PSKV2\0"), HEADER.size + len(PAYLOAD), "corrupt", "not a block file"),
    (header(key=bytes(16)), HEADER.size + len(PAYLOAD), "layout",
     "written for another model or layout"),
    (header(h=bytes(16)), HEADER.size + len(PAYLOAD), "corrupt", "holds another block"),
    (header(), HEADER.size + len(PAYLOAD) - 1, "truncated",
     f"{HEADER.size + len(PAYLOAD) - 1} bytes, header says {HEADER.size + len(PAYLOAD)}"),
    (header(), HEADER.size + len(PAYLOAD) + 1, "truncated",
     f"{HEADER.size + len(PAYLOAD) + 1} bytes, header says {HEADER.size + len(PAYLOAD)}"),
])
def test_each_bad_header_fails_with_its_reason(raw: bytes, size: int, reason: str,
                                               says: str) -> None:
    with pytest.raises(LoadFailed) as failed:
        check_header(raw, KEY, H, size)
    assert failed.value.reason == reason
    assert str(failed.value) == f"{reason}: {says}"


@pytest.mark.parametrize(("mangle", "reason"), [
    (lambda raw: raw[:-3], "truncated"),
    (lambda raw: raw[:HEADER.size] + bytes([raw[HEADER.size] ^ 1]) + raw[HEADER.size + 1:],
     "checksum"),
    (lambda raw: raw[:20] + bytes(16) + raw[36:], "layout"),  # another layout's key
    (lambda raw: b"x" + raw[1:], "corrupt"),
])
def test_each_bad_file_fails_with_its_reason(tmp_path: Path, mangle, reason: str) -> None:
    write_block(tmp_path, KEY, H, memoryview(PAYLOAD))
    path = tmp_path / file_name(H)
    path.write_bytes(mangle(path.read_bytes()))
    with pytest.raises(LoadFailed) as failed:
        read_block(path, KEY, H, len(PAYLOAD))
    assert failed.value.reason == reason
    if reason == "checksum":  # the file that failed is named
        assert str(failed.value) == f"checksum: {path}"


def test_a_missing_file_or_a_payload_of_another_size_fails(tmp_path: Path) -> None:
    with pytest.raises(LoadFailed) as missing:
        read_block(tmp_path / file_name(H), KEY, H, len(PAYLOAD))
    assert missing.value.reason == "missing"
    assert str(missing.value) == f"missing: {tmp_path / file_name(H)}"
    other = bytes(16)  # a whole file of another block under this block's name
    write_block(tmp_path, KEY, other, memoryview(PAYLOAD))
    (tmp_path / file_name(other)).rename(tmp_path / file_name(H))
    with pytest.raises(LoadFailed) as swapped:
        read_block(tmp_path / file_name(H), KEY, H, len(PAYLOAD))
    assert swapped.value.reason == "corrupt"
    (tmp_path / file_name(H)).unlink()
    write_block(tmp_path, KEY, H, memoryview(PAYLOAD))
    with pytest.raises(LoadFailed) as other:
        read_block(tmp_path / file_name(H), KEY, H, len(PAYLOAD) - 4)
    assert str(other.value) == "layout: payload of 512 bytes, not 508"
    (tmp_path / "dir.kv").mkdir()
    with pytest.raises(LoadFailed) as unreadable:
        read_block(tmp_path / "dir.kv", KEY, H, len(PAYLOAD))
    assert unreadable.value.reason == "read_error" and "dir.kv" in str(unreadable.value)


def test_a_load_failure_names_a_known_reason() -> None:
    assert str(LoadFailed("checksum", "f")) == "checksum: f"
    with pytest.raises(AssertionError):
        LoadFailed("bogus", "f")


def test_host_tier_slots_and_bookkeeping_only_tiers() -> None:
    with pytest.raises(ValueError, match="at least one"):
        HostTier(0)
    plain = HostTier(2)  # the simulator's: no contents
    assert plain.data is None and plain.put(b"a") is None and plain.get(b"a") is None
    assert plain.evict_lru() is None  # a slot is still free
    plain.put(b"b")
    assert plain.evict_lru() == (b"a", None) and len(plain) == 1 and b"b" in plain
    plain.clear()
    assert len(plain) == 0 and plain.evict_lru() is None
    assert plain.put(b"c") is None and plain.put(b"d") is None  # both slots free again
    real = HostTier(3, (2, 4))
    assert real.data.shape == (3, 2, 4) and not real.data.any()
    slot = real.put(b"x")
    slot.fill_(7.0)
    assert real.get(b"x").eq(7.0).all() and struct.calcsize(">H") == 2
