"""Pure routing policy: rank workers for one request by an estimated cost in seconds.

No Ray, no Redis: the caller gathers a :class:`WorkerView` per worker (matched depth from the
index, engine-reported load, what this router sent since that load was reported) and gets a
ranking back, so every case is testable on hand-built views.

Cost of sending a request with ``P`` prompt tokens to worker ``w``::

    cached_w   = block_size * (confirmed + predicted_credit * (predicted - confirmed))
                 capped at P - 1 (the last prompt token is always computed: its logits are needed)
    uncached_w = P - cached_w
    room_w     = max(0, block_size * kv_empty_blocks_w - queued_prefill_w)
    cost_w     = queued_prefill_w / prefill_rate_w
                 + uncached_weight * uncached_w / prefill_rate_ref
                 + eviction_weight * max(0, uncached_w - room_w) / prefill_rate_ref
                 + decode_weight * running_w / max(decode_rate_w, default_decode_rate)

The first term is the wait behind the worker's queued prefill work (at its own measured rate; an
unmeasured worker is assumed as fast as the measured mean). The second is this request's own
prefill, counted ``uncached_weight`` (default 6) times: for its TTFT, for the compute it takes
from the worker, and for the copy it adds to the cluster's caches (a prefix computed on a
second worker holds memory twice). It uses the mean measured rate of all workers, so
measurement noise between identical GPUs never decides a route at even load. The third is
what the new blocks evict: past the worker's empty room (free blocks holding no cached prefix,
less what its queue will take) each uncached token displaces a cached one that may be asked
for again. It steers new prefixes to workers with room rather than onto the few that hold a
shared system prompt, and is the same for every worker once all pools are full. The fourth is
the decode steps interleaved with it; the measured decode rate is floored at the default
because at small batches it overstates what one more batched sequence costs.

Why this instead of SGLang's global imbalance gate (abs 64 / rel 1.5 over all workers)? The
gate is global: one overloaded worker switches affinity off for every request, scattering
prefixes, lowering the hit rate, raising load, and keeping the gate open (the "death spiral").
Here each request compares only the costs it would see, so:

* a hot prefix spills to a second worker exactly when the holder's backlog outweighs the
  weighted saved prefill; the second worker then caches it and the two share it;
* at even load the holder always wins (saved prefill outweighs small load differences);
* an overloaded worker only loses the requests it would serve slowly.

Ties (costs within ``tie_tolerance_s`` of the best) go to the deeper match, then to the worker
least busy lately among those with nothing waiting (``WorkerLoad.busy_share``: at low load every
idle worker ties, and sending each new prefix to the one that has worked least keeps sticky
conversations from piling up on a few; where work waits, the queues decide), then by
rendezvous hashing of ``tie_key`` with the worker key. Both come from the workers'
reports or the request, so every router process breaks a tie the same way. The caller picks the
key (``router.router_state.tie_key``: the first block no worker holds).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from router.blocks import DEFAULT_BLOCK_SIZE
from router.events import WorkerLoad


def _weight(default: float, description: str) -> Any:
    """A field whose description the cluster config's flags and README table show."""
    return field(default=default, metadata={"description": description})


@dataclass(frozen=True)
class PolicyConfig:
    """The cost model's weights: the ``router.weights`` part of the cluster config."""

    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"internal": True})
    default_prefill_tokens_per_s: float = _weight(
        4000.0, "Prefill rate assumed until some worker has measured one")
    default_decode_tokens_per_s: float = _weight(
        1000.0, "Decode rate assumed until some worker has measured one")
    uncached_weight: float = _weight(
        6.0, "Cost of an uncached prompt token, in prefill token-times: this request's TTFT, "
        "the worker's compute, and the duplicate it makes in the cluster's caches")
    decode_weight: float = _weight(
        0.5, "Cost of one more decoding sequence, in token-times (decode is batched)")
    predicted_credit: float = _weight(
        0.95, "Worth of a predicted block against a confirmed one, in [0, 1]")
    eviction_weight: float = _weight(
        0.25, "Cost of evicting a cached token to make room, in token-times: the chance it "
        "is asked for again")
    tie_tolerance_s: float = _weight(
        0.001, "Costs this close tie (absorbs stale-load noise, about 2 running sequences)")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.default_prefill_tokens_per_s <= 0 or self.default_decode_tokens_per_s <= 0:
            raise ValueError("default rates must be > 0")
        if not 0.0 <= self.predicted_credit <= 1.0:
            raise ValueError("predicted_credit must be in [0, 1]")
        if self.uncached_weight < 1.0 or self.decode_weight < 0 or self.eviction_weight < 0:
            raise ValueError(
                "uncached_weight must be >= 1, decode_weight and eviction_weight >= 0")


# WorkerView and Score are made for every worker on every decision: slotted, not frozen (a
# frozen dataclass's __init__ sets each field through object.__setattr__, 2.5x the cost).
@dataclass(slots=True)
class WorkerView:
    """What one router knows about one worker when routing one request."""

    key: str  # the replica's unique id
    confirmed_depth: int = 0  # consecutive blocks confirmed by the worker's KV events
    predicted_depth: int = 0  # consecutive blocks confirmed OR predicted (>= confirmed_depth)
    load: WorkerLoad | None = None  # engine-reported (via the index); None when unknown
    pending_prefill_tokens: int = 0  # routed here by this router after `load` was reported
    pending_requests: int = 0
    queue_len: int | None = None  # Serve's count of ongoing requests (fallback when no load)


@dataclass(slots=True)
class Score:
    key: str
    cost_s: float
    cached_tokens: float  # expected (predicted blocks are discounted)
    uncached_tokens: float
    matched_blocks: int  # max(confirmed, predicted) depth
    new_tokens: int  # tokens to prefill if every predicted block lands (pending-work estimate)


def _cached(confirmed: np.ndarray, predicted: np.ndarray, num_prompt_tokens: int,
            config: PolicyConfig) -> np.ndarray:
    """Expected cached tokens per worker: predicted blocks at ``predicted_credit``, and never
    the prompt's last token (its logits are needed)."""
    extra = np.maximum(0, predicted - confirmed)
    blocks = confirmed + config.predicted_credit * extra
    return np.maximum(0.0, np.minimum(blocks * config.block_size, num_prompt_tokens - 1))


def reference_prefill_rate(workers: Sequence[WorkerView], config: PolicyConfig) -> float:
    """Mean measured prefill rate, or the default when no worker has measured one."""
    rates = [w.load.prefill_tokens_per_s for w in workers if w.load and w.load.prefill_tokens_per_s]
    return sum(rates) / len(rates) if rates else config.default_prefill_tokens_per_s


# A worker that has not reported: nothing queued, running or free that we know of, rates unmeasured
# (so the reference and default rates apply): what the cost model assumes without a load.
_UNREPORTED = WorkerLoad()


@dataclass
class _Costs:
    """The cost model's outputs over the fleet, one array entry per worker."""

    cost: np.ndarray
    cached: np.ndarray
    uncached: np.ndarray
    depth: np.ndarray
    new_tokens: np.ndarray

    def scores(self, workers: Sequence[WorkerView], order: Sequence[int]) -> list[Score]:
        """The workers' Scores, in ``order`` (indices into ``workers``)."""
        cost, cached, uncached = self.cost.tolist(), self.cached.tolist(), self.uncached.tolist()
        depth, new_tokens = self.depth.tolist(), self.new_tokens.tolist()
        return [Score(workers[i].key, cost[i], cached[i], uncached[i], depth[i], new_tokens[i])
                for i in order]


def _costs(
    workers: Sequence[WorkerView], num_prompt_tokens: int, config: PolicyConfig, ref_rate: float
) -> _Costs:
    """Every worker's cost as arrays over the fleet: a router scores every replica on every
    decision, and one interpreted pass per worker cost ~6 ms a decision at 1,000 workers."""
    loads = [w.load or _UNREPORTED for w in workers]
    confirmed = np.array([w.confirmed_depth for w in workers])
    predicted = np.array([w.predicted_depth for w in workers])
    cached = _cached(confirmed, predicted, num_prompt_tokens, config)
    uncached = num_prompt_tokens - cached
    depth = np.maximum(confirmed, predicted)
    prefill_rate = np.array([load.prefill_tokens_per_s or ref_rate for load in loads])
    decode_rate = np.maximum([load.decode_tokens_per_s for load in loads],
                             config.default_decode_tokens_per_s)
    queued = (np.array([load.queued_prefill_tokens for load in loads])
              + [w.pending_prefill_tokens for w in workers])
    running = np.maximum(np.array([load.num_running for load in loads])
                         + [w.pending_requests for w in workers],
                         [w.queue_len or 0 for w in workers])
    empty = np.array([load.kv_empty_blocks for load in loads]) * config.block_size
    evicted = np.maximum(0.0, uncached - np.maximum(0, empty - queued))  # queued work fills first
    cost = queued / prefill_rate + config.uncached_weight * uncached / ref_rate
    cost += config.eviction_weight * evicted / ref_rate
    cost += config.decode_weight * running / decode_rate
    new_tokens = num_prompt_tokens - np.minimum(depth * config.block_size, num_prompt_tokens - 1)
    return _Costs(cost, cached, uncached, depth, new_tokens)


def score(
    view: WorkerView, num_prompt_tokens: int, config: PolicyConfig, ref_rate: float
) -> Score:
    """One worker's cost (what :func:`rank` computes for all of them at once)."""
    return _costs([view], num_prompt_tokens, config, ref_rate).scores([view], [0])[0]


def rendezvous(tie_key: bytes, worker_key: str) -> int:
    """Stable across processes (unlike ``hash()``): every router breaks a tie the same way."""
    digest = hashlib.blake2b(tie_key + b"\x00" + worker_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def idle_busy_share(view: WorkerView) -> float:
    """The worker's busy share when nothing waits there (1.0 otherwise): it orders ties
    between workers with room, and not between saturated ones, where the queues decide."""
    load = view.load
    if load is None or load.num_waiting or load.queued_prefill_tokens or view.pending_requests:
        return 1.0
    return min(load.busy_share, 1.0)


def rank(
    num_prompt_tokens: int,
    workers: Sequence[WorkerView],
    config: PolicyConfig,
    tie_key: bytes = b"",
) -> list[Score]:
    """All workers, best first. The first entry is the choice; the rest are the fallbacks."""
    if num_prompt_tokens < 1:
        raise ValueError("a request has at least one prompt token")
    if not workers:
        return []
    costs = _costs(workers, num_prompt_tokens, config, reference_prefill_rate(workers, config))
    cost = costs.cost
    # Tied workers rank by depth, busy share, hash, not cost: load noise must not flip it. A cost
    # is positive (the last prompt token is always computed), so 0.0 puts the tied first.
    keys = np.stack([np.where(cost <= cost.min() + config.tie_tolerance_s, 0.0, cost),
                     -costs.depth, [idle_busy_share(w) for w in workers]])
    order = np.lexsort(keys[::-1])  # the first key decides first; equal keys keep their order
    ordered = keys[:, order]
    changes = np.flatnonzero((ordered[:, 1:] != ordered[:, :-1]).any(axis=0)) + 1
    ranking = costs.scores(workers, order.tolist())
    for start, end in pairwise([0, *changes.tolist(), len(ranking)]):
        group = ranking[start:end]
        if len(group) >= 2:  # equal in every key: the hash decides
            ranking[start:end] = sorted(group, key=lambda s: -rendezvous(tie_key, s.key))
    return ranking
