"""The host tier: a fixed number of block slots in (pinned, on a GPU server) host memory, LRU.

The tier keeps only which hash is in which slot and in what order; the engine's
:class:`workers.kv_tiers.offload.TieredKV` moves the contents (none in the simulator, where
``data`` is None).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class HostTier:
    def __init__(self, num_slots: int, block_shape: Sequence[int] | None = None,
                 dtype: torch.dtype = torch.float32, pin: bool = False) -> None:
        if num_slots < 1:
            raise ValueError("the host tier needs at least one block slot")
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.data = None if block_shape is None else torch.zeros(
            (num_slots, *block_shape), dtype=dtype, pin_memory=pin)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def touch(self, block_hash: bytes) -> None:
        """Used now: evicted last."""
        self.slots.move_to_end(block_hash)

    def evict_lru(self) -> tuple[bytes, torch.Tensor | None] | None:
        """Make room when full: drop the least recently used block; its hash and a view of its
        contents (valid until the next `put`), or None when there was room."""
        if self._free:
            return None
        block_hash, slot = self.slots.popitem(last=False)
        self._free.append(slot)
        return block_hash, None if self.data is None else self.data[slot]

    def put(self, block_hash: bytes) -> torch.Tensor | None:
        """Take a free slot for `block_hash` (call `evict_lru` first); the slot to fill."""
        slot = self._free.pop()
        self.slots[block_hash] = slot
        return None if self.data is None else self.data[slot]

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        return None if self.data is None else self.data[self.slots[block_hash]]

    def clear(self) -> None:
        self._free.extend(self.slots.values())
        self.slots.clear()
