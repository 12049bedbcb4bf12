"""KV cache events and worker load records: what a worker tells the global index.

Events are batched per engine step into an :class:`EventBatch` that carries the worker id,
its epoch (a new incarnation gets a new one) and a per-worker sequence number, so the index can
fence stale incarnations and detect lost batches. The wire format is a msgpack map with a
``type`` tag; :func:`decode_batch` rejects anything malformed with :class:`EventDecodeError`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from router.blocks import DIGEST_BYTES

WIRE_VERSION = 1


class EventDecodeError(ValueError):
    """A payload that is not a well-formed event batch or load record."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became cached (hash registered). ``parent`` is the digest before the first."""

    hashes: tuple[bytes, ...]
    parent: bytes | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks that were evicted."""

    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache (reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    worker_id: int
    epoch: int
    seq: int
    events: tuple[KVEvent, ...]
    timestamp: float = 0.0


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


def _encode_event(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {"type": "stored", "hashes": list(event.hashes), "parent": event.parent}
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "hashes": list(event.hashes)}
    if isinstance(event, AllBlocksCleared):
        return {"type": "cleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb(
        {
            "type": "batch",
            "v": WIRE_VERSION,
            "worker": batch.worker_id,
            "epoch": batch.epoch,
            "seq": batch.seq,
            "ts": batch.timestamp,
            "events": [_encode_event(e) for e in batch.events],
        },
        use_bin_type=True,
    )


def _int(obj: dict, key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise EventDecodeError(f"field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _digests(value: Any) -> tuple[bytes, ...]:
    if not isinstance(value, list):
        raise EventDecodeError("field 'hashes' must be a list")
    for h in value:
        if not isinstance(h, bytes) or len(h) != DIGEST_BYTES:
            raise EventDecodeError(f"block hash must be {DIGEST_BYTES} bytes, got {h!r}")
    return tuple(value)


def _decode_event(obj: Any) -> KVEvent:
    if not isinstance(obj, dict):
        raise EventDecodeError(f"event must be a map, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind == "stored":
        parent = obj.get("parent")
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != DIGEST_BYTES):
            raise EventDecodeError(f"parent must be {DIGEST_BYTES} bytes or nil")
        return BlockStored(_digests(obj.get("hashes")), parent)
    if kind == "removed":
        return BlockRemoved(_digests(obj.get("hashes")))
    if kind == "cleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {kind!r}")


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


def decode_batch(payload: bytes) -> EventBatch:
    obj = _unpack_map(payload, "batch")
    if obj.get("v") != WIRE_VERSION:
        raise EventDecodeError(f"unsupported wire version {obj.get('v')!r}")
    events = obj.get("events")
    if not isinstance(events, list):
        raise EventDecodeError("field 'events' must be a list")
    ts = obj.get("ts", 0.0)
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EventDecodeError("field 'ts' must be a number")
    return EventBatch(
        worker_id=_int(obj, "worker"),
        epoch=_int(obj, "epoch"),
        seq=_int(obj, "seq"),
        events=tuple(_decode_event(e) for e in events),
        timestamp=float(ts),
    )


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
