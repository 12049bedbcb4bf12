"""A KV block's bookkeeping record, and the free queue the pool evicts from in LRU order."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Block:
    """One KV block: ``block_size`` token slots of every layer's K and V."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) push, pop and unlink from the middle.

    A ``deque.remove`` here would be O(n) per cache hit (nano-vllm's weak spot).
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: never handed out
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.push_back(block)

    def _link(self, block: Block, before: Block) -> None:
        after_prev = before.prev
        assert after_prev is not None
        block.prev, block.next = after_prev, before
        after_prev.next = block
        before.prev = block
        self.num_free += 1

    def push_back(self, block: Block) -> None:
        self._link(block, self._tail)

    def push_front(self, block: Block) -> None:
        assert self._head.next is not None
        self._link(block, self._head.next)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free -= 1

    def pop_front(self) -> Block:
        block = self._head.next
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next
