"""One block's file in the disk tier, and the key that says which model and layout it fits.

A file is a fixed header then the block's bytes: magic, the layout key, the block hash, the
payload's length and its CRC-32. It is written to a temporary name and renamed into place, so a
file under its final name is whole unless the disk lied; the header and the checksum catch that
too. Nothing that fails a check is loaded: it is a miss, by reason (``base.LOAD_FAILURES``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

from prefixserve.workers.kv_tiers.base import LoadFailed

MAGIC = b"PSKV1\0"
HEADER = struct.Struct(">6s16s16sQI")  # magic, layout key, block hash, payload bytes, crc32
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


def layout_key(fingerprint: str, block_size: int, dtype: str, block_shape: tuple[int, ...],
               ) -> tuple[bytes, dict]:
    """The 16-byte key of everything a block's bytes depend on, and its readable form: the
    model's weights, the block size, the dtype and the tensor layout. Equal keys mean a file
    written by one worker loads right into another."""
    layout = {"model_fingerprint": fingerprint, "block_size": block_size, "dtype": dtype,
              "block_shape": list(block_shape), "format": MAGIC.decode().strip("\0")}
    text = json.dumps(layout, sort_keys=True).encode()
    return hashlib.sha256(text).digest()[:16], layout


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def hash_of(name: str) -> bytes | None:
    """The block hash a file name stands for; None for anything else."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None


def write_block(folder: Path, key: bytes, block_hash: bytes, payload: memoryview) -> int:
    """Write atomically (temporary file, then rename); returns the file's size."""
    header = HEADER.pack(MAGIC, key, block_hash, payload.nbytes, zlib.crc32(payload))
    final = folder / file_name(block_hash)
    tmp = folder / f".{final.name}.{os.getpid()}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HEADER.size + payload.nbytes


def check_header(raw: bytes, key: bytes, block_hash: bytes | None, size: int) -> int:
    """The payload length a file's header promises, after checking it against the layout key,
    the block hash (when given) and the file's size; LoadFailed otherwise."""
    if len(raw) < HEADER.size:
        raise LoadFailed("truncated", f"{len(raw)}-byte header")
    magic, file_key, file_hash, nbytes, _ = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise LoadFailed("corrupt", "not a block file")
    if file_key != key:
        raise LoadFailed("layout", "written for another model or layout")
    if block_hash is not None and file_hash != block_hash:
        raise LoadFailed("corrupt", "holds another block")
    if size != HEADER.size + nbytes:
        raise LoadFailed("truncated", f"{size} bytes, header says {HEADER.size + nbytes}")
    return nbytes


def read_block(path: Path, key: bytes, block_hash: bytes, nbytes: int) -> bytearray:
    """A block's payload, checked: header, length and checksum; LoadFailed otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise LoadFailed("missing", str(path)) from None
    except OSError as exc:
        raise LoadFailed("read_error", str(exc)) from None
    if check_header(raw, key, block_hash, len(raw)) != nbytes:
        raise LoadFailed("layout", f"payload of {len(raw) - HEADER.size} bytes, not {nbytes}")
    crc = HEADER.unpack_from(raw)[4]
    payload = memoryview(raw)[HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise LoadFailed("checksum", str(path))
    return bytearray(payload)
