"""The block-hash chain: the one protocol workers and routers must agree on.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``i`` is named by

    h_0 = H(ROOT,    tokens_0, namespace)
    h_i = H(h_{i-1}, tokens_i, extra_i)

where ``H`` is SHA-256 over a fixed little-endian binary layout, truncated to 16 bytes:

    b"PSB1" | parent (16 bytes) | u32 n_tokens | n_tokens x u32 token id | u32 n_extra | extra

``namespace`` folds the model fingerprint and the tenant's ``cache_salt`` into block 0, so two
models or two tenants never share a name for the same tokens. Python's ``hash()`` is never used:
it is process-seeded and made vLLM's prefix cache poisonable (GHSA-rm76-4mrf-v9r8).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

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


def _pack(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32s."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one block given its parent's digest (``ROOT`` for block 0)."""
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent digest must be {DIGEST_BYTES} bytes, got {len(parent)}")
    body = _pack(tokens)
    payload = _MAGIC + parent + _u32(len(tokens)) + body + _u32(len(extra)) + extra
    return hashlib.sha256(payload).digest()[:DIGEST_BYTES]


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
        # The rest as hash_block lays them out, from one packed buffer (about twice as fast
        # for a long prompt as packing block by block: the router hashes every prompt).
        body = _pack(self._pending[len(new) * size : full])
        parent = new[-1] if new else self.hashes[-1]
        head, count, no_extra = _MAGIC, _u32(size), _u32(0)
        step = 4 * size
        for start in range(0, len(body), step):
            parent = hashlib.sha256(
                head + parent + count + body[start : start + step] + no_extra
            ).digest()[:DIGEST_BYTES]
            new.append(parent)
        self.hashes.extend(new)
        del self._pending[:full]
        return new

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + len(self._pending)
