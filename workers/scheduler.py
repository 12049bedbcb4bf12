"""Continuous batching: which sequences run in the next forward pass, and how many tokens each.

Every step mixes decode tokens of running sequences with (chunked) prefill tokens of new ones in
one batch, bounded by ``max_num_batched_tokens`` and ``max_num_seqs`` (the vLLM v1 scheduler
shape). Running sequences go first, oldest first; when the pool runs dry the newest running
sequence is preempted by recompute: its blocks are released (hashed ones stay in the LRU list
as cache hits) and it rejoins the front of the queue, its generated tokens now part of its
prompt. Nothing is re-hashed on a retry.

With KV tiers below the pool (``workers.kv_tiers``), a sequence's first turn at admission also
walks the tiers past its pool hits: host copies load at once, and one that needs disk reads
waits in ``loading`` (not blocking anyone behind it) until they are in the pool, then goes back
to the front of the queue.

Admission is fair across tenants: a preempted sequence resumes first; otherwise the oldest
waiting sequence of the tenant with the fewest running sequences goes next (ties: the oldest),
so one tenant's flood cannot hold another's request behind it. Within a tenant, and with a
single tenant, this is plain FIFO. Running sequences use at most ``max_loras`` distinct LoRA
adapters (the batch's slots): a sequence whose adapter would be one too many waits, and those
behind it go first, as vLLM's scheduler skips it. Picking walks the waiting queue, which Serve
bounds (``max_ongoing_requests`` x ``n``); other work per step is O(scheduled sequences).
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixserve.router.blocks import BlockHasher
from prefixserve.workers.kv_cache import Block, KVCacheManager

if TYPE_CHECKING:
    from prefixserve.workers.kv_tiers.offload import TieredKV


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its prefix is being read from a lower KV tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request: its tokens, progress and block hashes (hashed once, as it grows)."""

    seq_id: str
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: Any  # workers.sampling.SamplingParams
    hasher: BlockHasher
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens hit at first admission; -1 before it
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    forked: bool = False  # the n-1 siblings of an n > 1 request have been created
    extra: dict[str, Any] = field(default_factory=dict)  # engine-private per-sample state
    tenant: str | None = None  # whose share of the batch it uses (fair admission)
    adapter: str | None = None  # its LoRA adapter's identity: a batch slot while it runs
    tiers_checked: bool = False  # the KV tiers below the pool were searched for its prefix
    device_hit_blocks: int = 0  # its pool hits then
    loaded_blocks: int = 0  # blocks loaded into the pool for it from lower tiers

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def hashes(self) -> list[bytes]:
        return self.hasher.hashes

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.hasher.append((token_id,))


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per scheduled sequence, same order
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    too_long: list[Sequence] = field(default_factory=list)  # cannot grow in the whole pool
    tables: list[list[Block]] = field(default_factory=list)  # per scheduled sequence, its blocks

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 1) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}  # waiting on lower-tier loads, by sequence id
        self.tiers: TieredKV | None = None  # the KV tiers below the pool, if any
        self.num_preemptions = 0
        self.prompt_tokens_queried = 0  # vLLM's prefix_cache_* counters: the pool's hits
        self.prompt_tokens_hit = 0
        self.external_tokens_queried = 0  # vLLM's external_prefix_cache_*: the lower tiers'
        self.external_tokens_hit = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to compute: unfinished chunks of running prompts, and waiting prompts
        less the prefix they are expected to hit (cached now, or computed by a sequence ahead
        of them). Routers compare this backlog across workers: a worker whose queue holds a
        group of requests behind one shared prefix must not look as busy as one that has to
        compute every prompt in full."""
        total = 0
        bs = self.kv.block_size
        coming: set[bytes] = set()  # blocks not cached yet that sequences ahead will compute
        for s in self.running:
            left = s.num_tokens - s.num_computed_tokens
            if left > 1:
                total += left
                coming.update(s.hashes[s.num_computed_tokens // bs:])
        for s in (*self.loading.values(), *self.waiting):
            hits = self.kv.expected_hit_blocks(s.hashes, s.num_tokens, coming)
            total += s.num_tokens - max(s.num_computed_tokens, hits * bs)
            coming.update(s.hashes[hits:])
        return total

    def schedule(self) -> SchedulerOutput:
        """The next step's batch, with each scheduled sequence's block table (all the model
        runner reads of the KV manager)."""
        out = self._schedule()
        out.tables = [self.kv.tables[seq.seq_id] for seq in out.seqs]
        return out

    def _schedule(self) -> SchedulerOutput:
        if self.tiers is not None:
            for done in self.tiers.poll():  # loaded: their turn had come, so at the front
                seq = self.loading.pop(done.seq_id)
                seq.status = SeqStatus.WAITING
                self.waiting.appendleft(seq)
        out = SchedulerOutput([], [])
        budget = self.max_num_batched_tokens
        kv = self.kv
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, n, seq.hashes):
                if kv.held:
                    self._drop_holds()
                    continue
                if len(self.running) == 1:
                    # alone and still no room: the pool cannot hold this sequence
                    self.running.pop()
                    out.too_long.append(seq)
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._take(out, seq, n)
                budget -= n
                i += 1
                continue
            break
        if out.preempted or out.too_long:
            return out
        running = Counter(s.tenant for s in self.running)
        adapters = self.running_adapters()
        dropped = False
        while self.waiting and budget > 0:
            seq = self._next_waiting(running, adapters)
            if seq is None:
                break
            fanout = 1 if seq.forked else seq.params.n
            if len(self.running) + fanout > self.max_num_seqs and self.running:
                break
            hits = kv.computed_blocks(seq.hashes, seq.num_tokens)
            if self.tiers is not None and not seq.tiers_checked:
                seq.tiers_checked = True
                seq.device_hit_blocks = len(hits)
                if self.tiers.start_load(seq, hits):
                    self.waiting.remove(seq)
                    seq.status = SeqStatus.LOADING
                    self.loading[seq.seq_id] = seq
                    continue
                hits = kv.computed_blocks(seq.hashes, seq.num_tokens)
            num_computed = len(hits) * kv.block_size
            n = min(seq.num_tokens - num_computed, budget)
            if not kv.allocate_slots(seq.seq_id, num_computed, n, seq.hashes, hits):
                if self.running or not kv.held or dropped:
                    break
                # Nothing runs to give blocks back, so blocks held for waiting sequences'
                # loads would be held forever: they go (their sequences search again).
                self._drop_holds()
                dropped = True
                continue
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            running[seq.tenant] += fanout
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            seq.num_computed_tokens = num_computed
            seq.status = SeqStatus.RUNNING
            if seq.num_cached_tokens < 0:
                self._count_hits(seq, num_computed)
            self.running.append(seq)
            self._take(out, seq, n)
            budget -= n
        return out

    def _count_hits(self, seq: Sequence, num_computed: int) -> None:
        """First admission: its cached tokens, split into the pool's and the lower tiers'
        (those loaded for it that it uses, after its pool hits)."""
        seq.num_cached_tokens = num_computed
        bs = self.kv.block_size
        external = max(0, min(seq.loaded_blocks * bs, num_computed - seq.device_hit_blocks * bs))
        self.prompt_tokens_queried += seq.num_prompt_tokens
        self.prompt_tokens_hit += num_computed - external
        if self.tiers is not None:
            self.external_tokens_queried += seq.num_prompt_tokens - (num_computed - external)
            self.external_tokens_hit += external

    def running_adapters(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter is not None}

    def _next_waiting(self, running: Counter[str | None], adapters: set[str]) -> Sequence | None:
        """The sequence whose turn it is, among those whose adapter fits the batch's slots
        (None: none does): a preempted one (they sit at the front) keeps its place; else the
        oldest one of the tenant running the fewest sequences, ties to the oldest. With one
        tenant and no adapters this is the queue's head, as FIFO."""
        full = len(adapters) >= self.max_loras
        best: Sequence | None = None
        seen: set[str | None] = set()
        for seq in self.waiting:
            if full and seq.adapter is not None and seq.adapter not in adapters:
                continue
            if best is None:
                best = seq
                if seq.num_preemptions:
                    return seq
                seen.add(seq.tenant)
            elif seq.tenant not in seen:
                seen.add(seq.tenant)
                if running[seq.tenant] < running[best.tenant]:
                    best = seq
            if running[best.tenant] == 0:
                break  # nobody runs fewer
        return best

    @staticmethod
    def _take(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        if seq.num_computed_tokens + n == seq.num_tokens and n == 1 and seq.num_output_tokens:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.tiers_checked = False  # its blocks may be lower down by its next turn
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a running or waiting sequence and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.LOADING:
            self._unload(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)

    def drop_requests(self, request_ids: Container[str]) -> None:
        """Retire every queued or running sample of these requests as "abort" and free its
        blocks; a sample a failed step had already finished but not yet removed goes too."""
        seqs = (*self.running, *self.waiting, *self.loading.values())
        for seq in [s for s in seqs if s.request_id in request_ids]:
            if seq.status is SeqStatus.LOADING:
                self._unload(seq)
            if seq.status is not SeqStatus.FINISHED:
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "abort"
            self.kv.free(seq.seq_id)
        self.running = [s for s in self.running if s.request_id not in request_ids]
        self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)

    def _drop_holds(self) -> None:
        """Running sequences come first: give back the blocks held for waiting sequences'
        prefixes (their loads are dropped; they search the tiers again at their turn)."""
        for seq in list(self.loading.values()):
            self._unload(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        for seq in self.waiting:
            if seq.seq_id in self.kv.held:
                seq.tiers_checked = False
        self.kv.release_held()

    def _unload(self, seq: Sequence) -> None:
        """A loading sequence ends: its loads are dropped (its blocks go when it is freed)."""
        del self.loading[seq.seq_id]
        if self.tiers is not None:
            self.tiers.cancel(seq.seq_id)

    def remove_finished(self, done: set[Sequence]) -> None:
        """Drop many finished running sequences in one O(running) pass."""
        if done:
            self.running = [s for s in self.running if s not in done]
