"""KV cache events and worker load records: what a worker tells the global index.

Events are batched per engine step into an :class:`EventBatch` that carries the worker id,
its epoch (a new incarnation gets a new one) and a per-worker sequence number, so the index can
fence stale incarnations and detect lost batches. A batch's events travel as one compact op
stream (:func:`encode_events`), the one event wire format: the index's apply script parses it
without unpacking a string per digest. Load records travel as msgpack maps
(:func:`encode_load`); :func:`decode_load` rejects anything malformed with
:class:`EventDecodeError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from prefixserve.router.blocks import DIGEST_BYTES, Chain


class EventDecodeError(ValueError):
    """A payload that is not a well-formed load record."""


# Where a worker holds a cached block, best first (vLLM's KV events call it the medium): its
# engine's pool, or a tier below it (workers/kv_tiers).
DEVICE, HOST, DISK = "device", "host", "disk"
MEDIA = (DEVICE, HOST, DISK)
_STORE_OPS = {DEVICE: b"S", HOST: b"H", DISK: b"D"}
_MEDIUM_OF_OP = {op: medium for medium, op in _STORE_OPS.items()}


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became cached (hash registered), in chain order, or that moved to
    ``medium``, now the best tier the worker holds them in."""

    hashes: tuple[bytes, ...]
    medium: str = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks the worker no longer holds in any tier."""

    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache (reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """One engine step's events of one worker incarnation, numbered so gaps show."""

    worker_id: int
    epoch: int
    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class WorkerLoad:
    """Engine-reported load: the signals the routing policy reads (not any router's own counts)."""

    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    timestamp: float = 0.0
    kv_empty_blocks: int = 0  # free blocks holding no cached prefix: filling them evicts nothing
    busy_share: float = 0.0  # of recent time spent in steps: ties go to the least busy
    kv_total_blocks: int = 0  # the pool's size: how full it is prices the room a request takes
    # how fast it loads KV from its tiers below the pool (measured; 0: none yet, or no tier)
    host_load_tokens_per_s: float = 0.0
    disk_load_tokens_per_s: float = 0.0


def pack_digests(digests: Sequence[bytes]) -> bytes:
    """Digests back to back (a :class:`Chain` as it is held); raises ValueError unless every one
    is 16 bytes long."""
    return Chain.of(digests).packed


_OP_HEAD = struct.Struct(">cI")  # an op stream's record: op, digest count


def encode_events(events: Sequence[KVEvent]) -> bytes:
    """The op stream of a batch: per event ``op | u32 BE count | count x 16-byte digest``.

    ``op`` is ``S``, ``H`` or ``D`` (stored, best held in the device pool, host memory or on
    disk), ``R`` (removed) or ``C`` (cleared, count 0).
    """
    parts = []
    for event in events:
        if isinstance(event, BlockStored):
            op, hashes = _STORE_OPS[event.medium], event.hashes
        elif isinstance(event, BlockRemoved):
            op, hashes = b"R", event.hashes
        elif isinstance(event, AllBlocksCleared):
            op, hashes = b"C", ()
        else:
            raise TypeError(f"not a KV event: {event!r}")
        parts.append(op + struct.pack(">I", len(hashes)) + pack_digests(hashes))
    return b"".join(parts)


def decode_events(ops: bytes) -> list[KVEvent]:
    """The events of an op stream (:func:`encode_events`), as a router following the index's
    event log reads them; :class:`EventDecodeError` for a malformed one."""
    events: list[KVEvent] = []
    pos = 0
    while pos < len(ops):
        try:
            op, count = _OP_HEAD.unpack_from(ops, pos)
        except struct.error:
            raise EventDecodeError(f"op stream cut short in the header at byte {pos}") from None
        start, pos = pos + _OP_HEAD.size, pos + _OP_HEAD.size + count * DIGEST_BYTES
        if pos > len(ops):
            raise EventDecodeError(f"op stream cut short: {count} digests need {pos} bytes")
        hashes = tuple(ops[k : k + DIGEST_BYTES] for k in range(start, pos, DIGEST_BYTES))
        if op in _MEDIUM_OF_OP:
            events.append(BlockStored(hashes, _MEDIUM_OF_OP[op]))
        elif op == b"R":
            events.append(BlockRemoved(hashes))
        elif op == b"C" and not count:
            events.append(AllBlocksCleared())
        else:
            raise EventDecodeError(f"unknown op {op!r} with {count} digests")
    return events


def _unpack_map(payload: bytes, expected_type: str) -> dict:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise EventDecodeError("payload must be bytes")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EventDecodeError(f"malformed msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("type") != expected_type:
        raise EventDecodeError(f"expected a map with type {expected_type!r}")
    return obj


_LOAD_FIELDS = {f.name: f.type for f in fields(WorkerLoad)}


def encode_load(load: WorkerLoad) -> bytes:
    return msgpack.packb({"type": "load", **asdict(load)}, use_bin_type=True)


def decode_load(payload: bytes) -> WorkerLoad:
    obj = _unpack_map(payload, "load")
    values: dict[str, Any] = {}
    for name, kind in _LOAD_FIELDS.items():
        value = obj.get(name, 0)
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not 0 <= value < math.inf):  # NaN and inf too: the policy divides by them
            raise EventDecodeError(f"load field {name!r} must be a finite non-negative number")
        values[name] = int(value) if kind == "int" else float(value)
    return WorkerLoad(**values)
