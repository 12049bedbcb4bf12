"""Pure routing policy: rank workers for one request by an estimated cost in seconds.

No Ray, no Redis: the caller gathers, per worker, the matched depth from the index, the
engine-reported load and what this router sent since that load was reported, as columns over
the fleet (:class:`Fleet`, what the router builds) or as one :class:`WorkerView` per worker (the
same, readable: every case is testable on hand-built views), and gets a :class:`Ranking` back.

Cost of sending a request with ``P`` prompt tokens to worker ``w``::

    cached_w   = block_size * (confirmed + predicted_credit * (predicted - confirmed))
                 capped at P - 1 (the last prompt token is always computed: its logits are needed)
    uncached_w = P - cached_w
    room_w     = max(0, block_size * kv_empty_blocks_w - queued_prefill_w)
    fill_w     = 1 - room_w / (block_size * kv_total_blocks_w)   (1 when the pool size is unknown)
    weight_w   = 1 + (uncached_weight - 1 + eviction_weight) * fill_w
    cost_w     = queued_prefill_w / prefill_rate_w
                 + weight_w * uncached_w / prefill_rate_ref
                 + decode_weight * running_w / max(decode_rate_w, default_decode_rate)
                 + adapter_w     (the request's LoRA adapter missing there: router.adapter_slots)
                 + host_w / host_load_rate_w + disk_w / disk_load_rate_w
                                 (of cached_w, the tokens below its pool: KV tiers)

The first term is the wait behind the worker's queued prefill work (at its own measured rate; an
unmeasured worker is assumed as fast as the measured mean). The second is this request's own
prefill, counted up to ``uncached_weight`` (default 6) times, plus ``eviction_weight``: once for
its TTFT, and the rest for the compute it takes from the worker and for the copy it adds to the
cluster's caches (a prefix computed on a second worker holds memory twice) and the cached tokens
that copy displaces. The rest counts as full as the worker's pool is (free blocks that hold no
cached prefix are room, less what its queue will take): a copy in room displaces nothing. The mean
measured rate of all workers prices it, so measurement noise between identical GPUs never decides a
route at even load. A worker with an empty pool (just started, or passed over) thus weighs a shared
prompt's tokens at one prefill and takes new conversations from the few workers that cached the
prompt first (counted six times there too, such workers stayed idle at light load while the holders
evicted each other's conversations). Once every pool is full, the weight is alike. The third is the
decode steps interleaved with it (the measured rate floored at the default: at small batches it
overstates what one more batched sequence costs). The last prices a cached prefix by where it is:
blocks in a worker's pool cost nothing, blocks in its host memory or on its disk
(``WorkerMatch.lower_blocks``) the time to load them, at the rate the worker measured (else the
default): cheaper than recomputing by orders of magnitude, so a lower tier still wins over no
cache, and a pool's copy over a lower one at equal load.

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
rendezvous hashing of ``tie_key`` with the worker key. Both come from the workers' reports or
the request, so every router process breaks a tie the same way. The caller picks the key
(``router.router_state.tie_key``: the first block no worker holds).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from prefixserve.router.blocks import DEFAULT_BLOCK_SIZE
from prefixserve.router.events import WorkerLoad
from prefixserve.router.load_table import load_rows


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
        "and (as full as the worker's KV pool is) the worker's compute and the duplicate it "
        "makes in the cluster's caches")
    decode_weight: float = _weight(
        0.5, "Cost of one more decoding sequence, in token-times (decode is batched)")
    predicted_credit: float = _weight(
        0.95, "Worth of a predicted block against a confirmed one, in [0, 1]")
    eviction_weight: float = _weight(
        0.5, "Cost of the room an uncached token takes, in token-times at a full KV pool (in "
        "proportion to how full it is): the cached token it displaces may be asked for again")
    default_host_load_tokens_per_s: float = _weight(
        200_000.0, "KV tokens a second a worker loads from its host tier, until it has "
        "measured its own")
    default_disk_load_tokens_per_s: float = _weight(
        20_000.0, "KV tokens a second a worker loads from its disk tier, until it has "
        "measured its own")
    adapter_miss_s: float = _weight(
        0.05, "Least cost, in seconds, of a request whose LoRA adapter a worker must load "
        "into a full set of batch slots: the load, the adapter it evicts, the wait for a slot")
    tie_tolerance_s: float = _weight(
        0.001, "Costs this close tie (absorbs stale-load noise, about 2 running sequences)")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if min(self.default_prefill_tokens_per_s, self.default_decode_tokens_per_s,
               self.default_host_load_tokens_per_s, self.default_disk_load_tokens_per_s) <= 0:
            raise ValueError("default rates must be > 0")
        if not 0.0 <= self.predicted_credit <= 1.0:
            raise ValueError("predicted_credit must be in [0, 1]")
        if self.uncached_weight < 1.0 or self.decode_weight < 0 or self.eviction_weight < 0:
            raise ValueError(
                "uncached_weight must be >= 1, decode_weight and eviction_weight >= 0")
        if self.adapter_miss_s < 0:
            raise ValueError("adapter_miss_s must be >= 0")


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
    lower_blocks: tuple[int, int] = (0, 0)  # of confirmed_depth, blocks in host memory, on disk


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


def reference_prefill_rate(loads: Sequence[WorkerLoad | None], config: PolicyConfig) -> float:
    """Mean measured prefill rate, or the default when no worker has measured one."""
    return _mean_rate(load_rows(loads)[:, 0], config)


def _mean_rate(prefill_rates: np.ndarray, config: PolicyConfig) -> float:
    rates = prefill_rates[prefill_rates != 0].tolist()  # in order: the same float sum
    return sum(rates) / len(rates) if rates else config.default_prefill_tokens_per_s


@dataclass(slots=True)
class Fleet:
    """The workers of one decision as columns, one entry per worker in the caller's order:
    what :class:`WorkerView` holds per worker. A router ranks every replica on every decision,
    and at 1,000 workers a record per worker costs more to make and read back than the model
    costs to compute."""

    keys: Sequence[str]
    confirmed: Sequence[int]
    predicted: Sequence[int]
    loads: Sequence[WorkerLoad | None]  # may be empty where ``rows`` are given
    pending_tokens: Sequence[int]
    pending_requests: Sequence[int]
    queue_len: Sequence[int]  # 0 where Serve's count is unknown
    # seconds to make the request's LoRA adapter usable there (router.adapter_slots); empty:
    # the base model
    adapter_s: Sequence[float] = ()
    # load_rows(loads), when the caller has them (router.candidate_loads); None: from loads
    rows: np.ndarray | None = None
    # each worker's (host, disk) blocks of its confirmed depth; empty: all in the pools
    lower: Sequence[tuple[int, int]] = ()
    # each key's index in ``keys``, when the caller keeps it; None: made when asked
    at: Mapping[str, int] | None = None

    @classmethod
    def of_rows(cls, rows: Sequence[tuple[str, int, int, WorkerLoad | None, int, int, int]],
                ) -> Fleet:
        """From one (key, confirmed, predicted, load, pending tokens, pending requests, queue
        length) tuple per worker; raises ValueError on a row of another length."""
        return cls(*(tuple(zip(*rows, strict=True)) or ((),) * 7))

    @classmethod
    def of(cls, views: Sequence[WorkerView]) -> Fleet:
        fleet = cls.of_rows([(v.key, v.confirmed_depth, v.predicted_depth, v.load,
                              v.pending_prefill_tokens, v.pending_requests, v.queue_len or 0)
                             for v in views])
        if any(any(v.lower_blocks) for v in views):
            fleet.lower = [v.lower_blocks for v in views]
        return fleet


class Ranking:
    """Workers best first: the first is the choice, the rest are the fallbacks. Held as the cost
    model's arrays in the caller's order and the order over them; the keys in order and a
    :class:`Score` are made only where read (a decision reads one or two)."""

    def __init__(self, keys: Sequence[str], costs: _Costs, order: np.ndarray,
                 at: Mapping[str, int] | None = None) -> None:
        self._keys, self._costs, self._order = keys, costs, order
        self._at = at  # each key's index in ``keys``; None: made when first asked

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, i: int) -> Score:
        return self._score(int(self._order[i]))

    def __iter__(self) -> Iterator[Score]:
        return (self[i] for i in range(len(self)))

    @cached_property
    def keys(self) -> list[str]:
        """Every worker's key, best first."""
        keys = self._keys
        return [keys[i] for i in self._order.tolist()]

    def of(self, key: str) -> Score | None:
        """``key``'s entry; None for a worker not ranked."""
        if self._at is None:
            self._at = {k: i for i, k in enumerate(self._keys)}
        i = self._at.get(key)
        return None if i is None else self._score(i)

    @property
    def deepest(self) -> int:
        """The deepest match (blocks) of any worker ranked."""
        return int(self._costs.depth.max(initial=0))

    def _score(self, i: int) -> Score:
        c = self._costs
        return Score(self._keys[i], float(c.cost[i]), float(c.cached[i]), float(c.uncached[i]),
                     int(c.depth[i]), int(c.new_tokens[i]))


@dataclass
class _Costs:
    """The cost model's outputs over the fleet, one array entry per worker."""

    cost: np.ndarray
    cached: np.ndarray
    uncached: np.ndarray
    depth: np.ndarray
    new_tokens: np.ndarray
    # The busy share where nothing waits (1.0 otherwise): it orders ties between workers with
    # room, and not between saturated ones, where the queues decide.
    idle_busy_share: np.ndarray


def _costs(fleet: Fleet, table: np.ndarray, num_prompt_tokens: int, config: PolicyConfig,
           ref_rate: float) -> _Costs:
    """Every worker's cost as arrays over the fleet (``table``: its load rows): a router scores
    every replica on every decision, and one interpreted pass per worker cost ~6 ms a decision
    at 1,000 workers."""
    (prefill_rate, decode_rate, reported_queue, reported_running, empty, waiting, busy, total,
     host_rate, disk_rate) = table.T
    confirmed, predicted = np.asarray(fleet.confirmed), np.asarray(fleet.predicted)
    cached = _cached(confirmed, predicted, num_prompt_tokens, config)
    uncached = num_prompt_tokens - cached
    depth = np.maximum(confirmed, predicted)
    prefill_rate = np.where(prefill_rate > 0, prefill_rate, ref_rate)
    decode_rate = np.maximum(decode_rate, config.default_decode_tokens_per_s)
    pending = np.array(fleet.pending_requests)
    queued = reported_queue + fleet.pending_tokens
    running = np.maximum(reported_running + pending, fleet.queue_len)
    empty = empty * config.block_size  # not in place: the rows may be the caller's
    room = np.maximum(0, empty - queued)  # queued work fills first
    total = total * config.block_size
    fill = 1.0 - np.minimum(room, total) / np.maximum(total, 1.0)  # unknown size: a full pool
    weight = 1.0 + (config.uncached_weight - 1.0 + config.eviction_weight) * fill
    cost = queued / prefill_rate + weight * uncached / ref_rate
    cost += config.decode_weight * running / decode_rate
    if len(fleet.adapter_s):
        cost += np.asarray(fleet.adapter_s, dtype=float)
    if len(fleet.lower):
        cost += _load_s(fleet.lower, cached, host_rate, disk_rate, config)
    new_tokens = num_prompt_tokens - np.minimum(depth * config.block_size, num_prompt_tokens - 1)
    idle = (waiting == 0) & (reported_queue == 0) & (pending == 0)
    busy = np.where(idle, np.minimum(busy, 1.0), 1.0)
    return _Costs(cost, cached, uncached, depth, new_tokens, busy)


def _load_s(lower: Sequence[tuple[int, int]], cached: np.ndarray, host_rate: np.ndarray,
            disk_rate: np.ndarray, config: PolicyConfig) -> np.ndarray:
    """Seconds to load each worker's cached tokens that are below its pool (disk: the tail)."""
    blocks = np.asarray(lower, dtype=float).reshape(-1, 2) * config.block_size
    host = np.minimum(blocks[:, 0], cached)
    disk = np.minimum(blocks[:, 1], cached - host)
    host_rate = np.where(host_rate > 0, host_rate, config.default_host_load_tokens_per_s)
    disk_rate = np.where(disk_rate > 0, disk_rate, config.default_disk_load_tokens_per_s)
    return host / host_rate + disk / disk_rate


def score(
    view: WorkerView, num_prompt_tokens: int, config: PolicyConfig, ref_rate: float
) -> Score:
    """One worker's cost (what :func:`rank` computes for all of them at once)."""
    fleet = Fleet.of([view])
    costs = _costs(fleet, load_rows(fleet.loads), num_prompt_tokens, config, ref_rate)
    return Ranking([view.key], costs, np.arange(1))[0]


@lru_cache(maxsize=65_536)
def _worker_hash(worker_key: str) -> int:
    """A worker key's 64 bits for :func:`rendezvous` (cached: a decision needs every worker's)."""
    return int.from_bytes(hashlib.blake2b(worker_key.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=16)
def _worker_hashes(worker_keys: tuple[str, ...]) -> np.ndarray:
    """Every worker key's 64 bits (cached: a router's candidates are the same replicas decision
    after decision). Read only."""
    return np.array([_worker_hash(k) for k in worker_keys], dtype=np.uint64)


_M1, _M2, _33 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(33)


def _rendezvous(tie_key: bytes, worker_keys: Sequence[str]) -> np.ndarray:
    """Every worker's rendezvous weight for ``tie_key`` at once: the key's BLAKE2b-64 XOR the
    worker's, through MurmurHash3's 64-bit finalizer (a bijection that spreads every input bit
    over the output), so a tie among 1,000 idle workers costs no hash call per worker."""
    tie = int.from_bytes(hashlib.blake2b(tie_key, digest_size=8).digest(), "big")
    z = _worker_hashes(tuple(worker_keys)) ^ np.uint64(tie)
    z ^= z >> _33
    z *= _M1
    z ^= z >> _33
    z *= _M2
    z ^= z >> _33
    return z


def rendezvous(tie_key: bytes, worker_key: str) -> int:
    """The weight of ``worker_key`` for ``tie_key``; the tied worker with the highest goes
    first. Stable across processes (unlike ``hash()``): every router breaks a tie the same way."""
    return int(_rendezvous(tie_key, [worker_key])[0])


def rank(
    num_prompt_tokens: int,
    workers: Sequence[WorkerView] | Fleet,
    config: PolicyConfig,
    tie_key: bytes = b"",
) -> Ranking:
    """All workers, best first. The first entry is the choice; the rest are the fallbacks."""
    if num_prompt_tokens < 1:
        raise ValueError("a request has at least one prompt token")
    fleet = workers if isinstance(workers, Fleet) else Fleet.of(workers)
    rows = load_rows(fleet.loads) if fleet.rows is None else fleet.rows
    costs = _costs(fleet, rows, num_prompt_tokens, config, _mean_rate(rows[:, 0], config))
    cost = costs.cost
    # Tied workers rank by depth, busy share, hash, not cost: load noise must not flip it. A cost
    # is positive (the last prompt token is always computed), so 0.0 puts the tied first.
    tied = np.where(cost <= cost.min(initial=np.inf) + config.tie_tolerance_s, 0.0, cost)
    weight = _rendezvous(tie_key, fleet.keys)
    order = np.lexsort((~weight, costs.idle_busy_share, -costs.depth, tied))  # the last key first
    return Ranking(fleet.keys, costs, order, fleet.at)
