"""The block-hash chain: the one protocol workers and routers must agree on.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``i`` is named by

    h_0 = H(ROOT,    tokens_0, namespace)
    h_i = H(h_{i-1}, tokens_i, extra_i)

where ``H`` is SHA-256 over a fixed little-endian binary layout, truncated to 16 bytes:

    b"PSB1" | parent (16 bytes) | u32 n_tokens | n_tokens x u32 token id | u32 n_extra | extra

``namespace`` folds the model fingerprint and the tenant's ``cache_salt`` into block 0, so two
models or two tenants never share a name for the same tokens. Python's ``hash()`` never names a
block: it is process-seeded and made vLLM's prefix cache poisonable (GHSA-rm76-4mrf-v9r8). Only
the router's :class:`ChainMemo` finds runs it hashed before by it, where a collision could only
misroute.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

DEFAULT_BLOCK_SIZE = 16
DIGEST_BYTES = 16
_MAGIC = b"PSB1"
ROOT: bytes = hashlib.sha256(b"prefixserve/block-hash/v1/root").digest()[:DIGEST_BYTES]

BlockHash = bytes


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def namespace(model_fingerprint: str, cache_salt: str | None = None) -> bytes:
    """The 16-byte namespace folded into block 0: model fingerprint plus tenant salt."""
    fp = model_fingerprint.encode()
    salt = b"" if cache_salt is None else cache_salt.encode()
    has_salt = b"\x00" if cache_salt is None else b"\x01"
    payload = b"PSN1" + _u32(len(fp)) + fp + has_salt + _u32(len(salt)) + salt
    return hashlib.sha256(payload).digest()[:DIGEST_BYTES]


_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "big"


def token_array(tokens: Sequence[int]) -> array:
    """Token ids as native u32s: how a request carries its prompt. Converting a list costs about
    15 ns an id (1 ms for an 80,000-token prompt), so the ingress does it once where the ids are
    made; after that the router packs any part of the prompt with one copy, and Ray ships it as
    one buffer (pickling a list of 80,000 ids costs 60 times more)."""
    try:
        return array(_U32, tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def _pack(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32s (through ``array``: twice as fast as ``struct.pack`` with
    one argument per token, and one copy from a :func:`token_array`)."""
    packed = token_array(tokens)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one block given its parent's digest (``ROOT`` for block 0)."""
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent digest must be {DIGEST_BYTES} bytes, got {len(parent)}")
    body = _pack(tokens)
    payload = _MAGIC + parent + _u32(len(tokens)) + body + _u32(len(extra)) + extra
    return hashlib.sha256(payload).digest()[:DIGEST_BYTES]


def _hash_packed(parent: bytes, body: bytes, block_size: int) -> list[BlockHash]:
    """The digests of the whole blocks packed in ``body``, chained from ``parent``, laid out as
    hash_block does (from one packed buffer: about twice as fast for a long prompt as packing
    block by block, and the router hashes every prompt)."""
    head, count, no_extra = _MAGIC, _u32(block_size), _u32(0)
    step = 4 * block_size
    out: list[BlockHash] = []
    for start in range(0, len(body), step):
        parent = hashlib.sha256(
            head + parent + count + body[start : start + step] + no_extra
        ).digest()[:DIGEST_BYTES]
        out.append(parent)
    return out


def hash_chain(
    token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, ns: bytes = b""
) -> list[BlockHash]:
    """Digests of every full block of ``token_ids``; a trailing partial block is not hashed."""
    hasher = BlockHasher(block_size, ns)
    return hasher.append(token_ids)


class BlockHasher:
    """Incremental chain: append tokens as they arrive, get the digests of newly full blocks.

    Each block is hashed exactly once per request, however often it is scheduled.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, ns: bytes = b"") -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.namespace = ns
        self.hashes: list[BlockHash] = []
        self._pending: list[int] = []

    def append(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Add tokens; return the digests of the blocks they completed (possibly none)."""
        self._pending.extend(token_ids)
        size = self.block_size
        full = len(self._pending) - len(self._pending) % size
        if not full:
            return []
        new: list[BlockHash] = []
        if not self.hashes:
            new.append(hash_block(ROOT, self._pending[:size], self.namespace))
        body = _pack(self._pending[len(new) * size : full])
        new += _hash_packed(new[-1] if new else self.hashes[-1], body, size)
        self.hashes.extend(new)
        del self._pending[:full]
        return new

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + len(self._pending)


class Chain(Sequence[BlockHash]):
    """A chain of block digests held packed: one bytes object, 16 bytes a block.

    A router's chain goes from its memo (which remembers runs packed) to the index lookup (which
    sends it packed): held as a list, an 80,000-token prompt's 5,000 digests were unpacked from
    the memo and joined again for every lookup, about 0.5 ms of a decision. Indexing reads one
    digest; a slice is a Chain; ``extend`` grows it in place, so a holder of the object (this
    router's recent decisions) sees the blocks hashed after the decision.
    """

    __slots__ = ("_packed",)

    def __init__(self, packed: bytes = b"") -> None:
        if len(packed) % DIGEST_BYTES:
            raise ValueError(f"a packed chain is a multiple of {DIGEST_BYTES} bytes")
        self._packed = bytes(packed)

    @classmethod
    def of(cls, digests: Iterable[BlockHash]) -> Chain:
        """From digests; raises ValueError unless each is ``DIGEST_BYTES`` long."""
        if isinstance(digests, Chain):
            return cls(digests._packed)
        if not isinstance(digests, (list, tuple)):
            digests = list(digests)
        packed = b"".join(digests)
        # the total is right and none is shorter <=> every digest has the right length
        if len(packed) != DIGEST_BYTES * len(digests) or (
            digests and min(map(len, digests)) < DIGEST_BYTES
        ):
            raise ValueError(f"block digests must be {DIGEST_BYTES} bytes each")
        return cls(packed)

    @property
    def packed(self) -> bytes:
        """The digests back to back, as the index's scripts read them."""
        return self._packed

    def __len__(self) -> int:
        return len(self._packed) // DIGEST_BYTES

    @overload
    def __getitem__(self, i: int) -> BlockHash: ...
    @overload
    def __getitem__(self, i: slice) -> Chain: ...

    def __getitem__(self, i: int | slice) -> BlockHash | Chain:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return Chain.of([self[k] for k in range(start, stop, step)])
            return Chain(self._packed[start * DIGEST_BYTES : max(start, stop) * DIGEST_BYTES])
        n = len(self)
        if not -n <= i < n:
            raise IndexError("chain index out of range")
        at = (i % n) * DIGEST_BYTES
        return self._packed[at : at + DIGEST_BYTES]

    def __iter__(self) -> Iterator[BlockHash]:
        packed = self._packed
        return (packed[at : at + DIGEST_BYTES] for at in range(0, len(packed), DIGEST_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Chain):
            return self._packed == other._packed
        if isinstance(other, Sequence) and not isinstance(other, (bytes, str)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # it grows: not a dict key

    def __repr__(self) -> str:
        return f"Chain({len(self)} blocks)"

    def extend(self, digests: Iterable[BlockHash]) -> None:
        """Append blocks (a Chain's without unpacking it)."""
        more = digests if isinstance(digests, Chain) else Chain.of(digests)
        self._packed += more._packed


class ChainMemo:
    """Recently hashed runs of blocks, so a prompt that starts like an earlier one (a chat's next
    turn, a shared system prompt or document) hashes only what is new.

    A run is ``RUN_BLOCKS`` full blocks, found by Python's 64-bit hash of its parent digest (the
    namespace for the first run) and its packed token ids, and stored as its digests packed in
    one bytes object (about 1.4 bytes per prompt token at 16-token blocks, a third of what a
    tuple of digest objects takes), which a :class:`Chain` takes as it is. The hash is seeded per
    process, so nobody can aim a collision, and a chance one (about 1e-8 with a million runs
    held) only misroutes: routers use chains to choose, workers hash their own blocks. Two
    generations bound the memory: when the young one holds ``max_runs`` runs it becomes the old
    one and the previous old one is dropped; a hit in the old one moves the run back to the
    young one.
    """

    RUN_BLOCKS = 16
    WINDOW_RUNS = 16  # runs packed at a time: a long prompt is packed only as far as it is read

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, max_runs: int = 16384) -> None:
        if block_size < 1 or max_runs < 0:
            raise ValueError("block_size must be >= 1 and max_runs >= 0")
        self.block_size = block_size
        self.max_runs = max_runs
        self._young: dict[int, bytes] = {}  # run key -> the run's digests, packed
        self._old: dict[int, bytes] = {}
        self.hit_blocks = 0  # blocks served from the memo (a gauge of what it saves)

    def chain(
        self, token_ids: Sequence[int], ns: bytes = b"", budget: int | None = None,
        known: Sequence[BlockHash] = (), limit: int = sys.maxsize,
    ) -> Chain:
        """What ``hash_chain(token_ids[:limit], block_size, ns)`` returns (without copying the
        tokens: a long prompt's copy costs a tenth of its walk); with ``budget``, only its first
        blocks: the ones remembered and at most ``budget`` more. ``known`` is a first part of
        that chain computed before (a decision's, now wanted whole): the walk resumes at its
        last whole run instead of reading every token again."""
        size = self.block_size
        end = min(len(token_ids), limit) // size * size  # the tokens of full blocks
        if not self.max_runs:
            return Chain.of(hash_chain(
                token_ids[: end if budget is None else min(end, budget * size)], size, ns))
        run = 4 * size * self.RUN_BLOCKS  # bytes
        left = end // size if budget is None else budget  # blocks still to hash
        runs = len(known) // self.RUN_BLOCKS * self.RUN_BLOCKS
        parts = [Chain.of(known[:runs]).packed]  # the chain, packed, in parts
        blocks = runs
        parent, start = (parts[0][-DIGEST_BYTES:] if blocks else ns), blocks * size
        while start < end:
            body = _pack(token_ids[start : min(end, start + run // 4 * self.WINDOW_RUNS)])
            start += len(body) // 4
            pos = 0
            while pos + run <= len(body):
                key = hash((parent, body[pos : pos + run]))
                packed = self._young.get(key)
                if packed is None:
                    packed = self._old.get(key)
                    if packed is None:
                        break
                    self._remember(key, packed)
                parts.append(packed)
                blocks += self.RUN_BLOCKS
                self.hit_blocks += self.RUN_BLOCKS
                parent, pos = packed[-DIGEST_BYTES:], pos + run
            if pos < len(body):  # past what is remembered (or a last partial run): hash
                fresh = body[pos : pos + 4 * size * left]
                if not fresh:
                    break
                new = b"".join(self._hash(parent, fresh, first=not blocks))
                step = DIGEST_BYTES * self.RUN_BLOCKS
                for at in range(0, len(new) - step + 1, step):
                    prev = new[at - DIGEST_BYTES : at] if at else parent
                    tokens_at = at // DIGEST_BYTES * 4 * size
                    self._remember(hash((prev, fresh[tokens_at : tokens_at + run])),
                                   new[at : at + step])
                parts.append(new)
                n = len(new) // DIGEST_BYTES
                blocks, parent, left = blocks + n, new[-DIGEST_BYTES:], left - n
                if len(fresh) < len(body) - pos:  # the budget ends inside this window
                    break
        return Chain(b"".join(parts))

    @property
    def num_runs(self) -> int:
        """Runs held, in both generations (a run in both counts twice)."""
        return len(self._young) + len(self._old)

    def _hash(self, parent: bytes, body: bytes, first: bool) -> list[BlockHash]:
        """Digests of the packed full blocks in ``body`` after ``parent`` (for the chain's first
        block, ``parent`` is the namespace, folded in as hash_block does)."""
        if not first:
            return _hash_packed(parent, body, self.block_size)
        step = 4 * self.block_size
        head = hashlib.sha256(_MAGIC + ROOT + _u32(self.block_size) + body[:step]
                              + _u32(len(parent)) + parent).digest()[:DIGEST_BYTES]
        return [head, *_hash_packed(head, body[step:], self.block_size)]

    def _remember(self, key: int, packed: bytes) -> None:
        if len(self._young) >= self.max_runs:
            self._old, self._young = self._young, {}
        self._young[key] = packed
