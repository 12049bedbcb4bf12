"""How true the prefix index was, judged by the worker a request reached: the cached depth the
router credited here (``GenerateRequest.expected``) against the prefix the engine found.

The difference, in blocks (found less expected), goes to a histogram. A request off by more than
one block is counted by its cause where one is known:

- ``failopen``: the router ranked it without the index;
- ``partial``: the index's shard holding this worker's part did not answer the lookup;
- ``serve``: Serve sent it past the router's first choice (the router's depth for this worker
  still travels with it, so the difference is real, but the choice was not the router's);
- ``evicted``: the first block expected and not found was held here and evicted in between
  (it is among the recent removals this worker's KV events announced);
- ``never_stored``: it was not, so the index (or a prediction) named a block this worker never
  held, or held so long ago that the removals window has let it go;
- ``not_indexed``: more was found than expected (the index had not seen those blocks yet).

The expectation is capped at the blocks before the prompt's last token, which the engine never
takes from the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixserve.router import blocks
from prefixserve.router.adapters import adapter_fingerprint
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, KVEvent
from prefixserve.router.request import GenerateRequest

REMOVALS_WINDOW = 65_536  # recent removals remembered (16-byte digests: about 6 MB)
CAUSES = ("failopen", "partial", "serve", "evicted", "never_stored", "not_indexed")


class IndexTruth:
    """One worker's judge. ``on_events`` runs on the engine thread, ``judge`` on the
    replica's loop: a digest added while another is looked up is harmless."""

    def __init__(self, fingerprint: str, block_size: int, window: int = REMOVALS_WINDOW) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.window = window
        self._removed: OrderedDict[bytes, None] = OrderedDict()
        self._removals = 0  # removals seen, a cleared cache counting as a window's worth
        self._cleared_at: int | None = None  # removals seen when the cache was last cleared
        self.judged = 0
        self.off: dict[str, int] = dict.fromkeys(CAUSES, 0)

    def on_events(self, events: Sequence[KVEvent]) -> None:
        """Remember what the engine removed (the window's oldest go first)."""
        for event in events:
            if isinstance(event, BlockRemoved):
                for digest in event.hashes:
                    self._removed[digest] = None
                    self._removed.move_to_end(digest)
                self._removals += len(event.hashes)
            elif isinstance(event, AllBlocksCleared):
                self._cleared_at = self._removals
        while len(self._removed) > self.window:
            self._removed.popitem(last=False)

    def judge(self, request: GenerateRequest, cached_tokens: int) -> tuple[int, str | None]:
        """The difference (blocks) and, when it is more than one block, its cause; counted.
        Only for a request that carries ``expected``."""
        expected = request.expected
        assert expected is not None
        tokens = request.prompt_token_ids
        bs = self.block_size
        want = min(expected.blocks, (len(tokens) - 1) // bs)
        got = cached_tokens // bs
        diff = got - want
        self.judged += 1
        if abs(diff) <= 1:
            return diff, None
        if expected.reason is not None:
            cause = expected.reason
        elif diff > 0:
            cause = "not_indexed"
        else:
            cause = "evicted" if self._was_removed(request, got) else "never_stored"
        self.off[cause] += 1
        return diff, cause

    def _was_removed(self, request: GenerateRequest, block: int) -> bool:
        """Whether the request's ``block``-th block is among the recent removals (every block
        is, within a window's removals after the cache was cleared)."""
        if self._cleared_at is not None and self._removals - self._cleared_at < self.window:
            return True
        ns = blocks.namespace(adapter_fingerprint(self.fingerprint, request.lora),
                              request.cache_salt)
        chain = blocks.hash_chain(request.prompt_token_ids[: (block + 1) * self.block_size],
                                  self.block_size, ns)
        return chain[block] in self._removed
