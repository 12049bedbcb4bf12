"""A router's copy of the index at fleet scale: bytes per (block, worker) entry and lookup time
of :class:`router.local_index.LocalIndex` (packed arrays and a bounded delta), beside the plain
Python form it replaced (a dict of holder bitmasks and a set of keys per worker), filled with
the same fleet in the same session.

    python -m prefixserve.bench.micro.router_copy                  # 1,000 workers, ~30M entries
    python -m prefixserve.bench.micro.router_copy --workers 100    # scaled down

The fleet is the index benchmark's (bench/micro/index_scale.py: conversations of 512 blocks
whose first blocks are shared chains picked with Zipf popularity). Memory is every object the
copy holds, counted with ``sys.getsizeof`` (the arrays' buffers, each dict, set, key and
bitmask), as the fill left it and once its delta is merged; the plain form is filled for
``--baseline-workers`` workers only (it takes ~150 B an entry).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time

from prefixserve.bench.load.machine import cpu_name
from prefixserve.bench.micro.index_scale import Fleet, split
from prefixserve.bench.percentile import percentile
from prefixserve.router.blocks import Chain
from prefixserve.router.events import BlockStored
from prefixserve.router.local_index import KEY, LocalIndex


class PlainCopy:
    """The form the router kept before: holders per key, keys per worker (store only)."""

    def __init__(self) -> None:
        self.holders: dict[bytes, int] = {}
        self.blocks: dict[int, set[bytes]] = {}

    def store(self, worker: int, hashes: tuple[bytes, ...]) -> None:
        bit, held = 1 << worker, self.blocks.setdefault(worker, set())
        for h in hashes:
            k = h[:KEY]
            self.holders[k] = self.holders.get(k, 0) | bit
            held.add(k)

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks.values())


def footprint(copy: LocalIndex | PlainCopy) -> int:
    """Bytes of every object the copy holds (a key shared by two containers counted once)."""
    size = sys.getsizeof
    if isinstance(copy, PlainCopy):
        total = size(copy.holders) + size(copy.blocks)
        total += sum(size(k) + size(v) for k, v in copy.holders.items())
        return total + sum(size(held) for held in copy.blocks.values())
    total = copy.nbytes
    tables = [copy._slots, copy._ids]
    for entries in (copy._held, *copy._lower.values()):  # each tier's delta
        tables += [entries._added, entries._removed]
    for table in tables:
        total += size(table) + sum(size(k) + size(v) for k, v in table.items())
    return total


def fill(copy: LocalIndex | PlainCopy, fleet: Fleet, workers: int,
         keep: list[bytes], rng: random.Random) -> float:
    """Every worker's conversations, one BlockStored each; returns the seconds it took."""
    start = time.perf_counter()
    for worker in range(workers):
        for blob in fleet.conversations(worker):
            hashes = split(blob)
            if isinstance(copy, LocalIndex):
                copy.apply(worker, [BlockStored(hashes)])
            else:
                copy.store(worker, hashes)
            if rng.random() < 0.01:
                keep.append(blob)
    return time.perf_counter() - start


def lookups(index: LocalIndex, chains: list[bytes], blocks: int, n: int) -> list[float]:
    """Milliseconds per `depths` of the first ``blocks`` blocks of kept conversations."""
    out = []
    for i in range(n):
        chain = Chain.of(split(chains[i % len(chains)])[:blocks])
        start = time.perf_counter()
        index.depths(chain)
        out.append(1000 * (time.perf_counter() - start))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--baseline-workers", type=int, default=100)
    p.add_argument("--convs", type=int, default=59, help="59 x 512 blocks ~ 30,000 a worker")
    p.add_argument("--conv-blocks", type=int, default=512)
    p.add_argument("--pool-chains", type=int, default=4096)
    p.add_argument("--shared-lens", default="0,32,128,256,512")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    fleet = Fleet(args.workers, args.convs, args.conv_blocks, args.pool_chains,
                  [int(x) for x in args.shared_lens.split(",")], args.zipf, args.seed)
    print(f"{platform.machine()} {cpu_name()}; {args.workers} workers x {args.convs} "
          f"conversations of {args.conv_blocks} blocks")
    rng = random.Random(args.seed)
    rows = []
    for label, make, workers in (("plain dicts", PlainCopy, args.baseline_workers),
                                 ("packed (LocalIndex)", LocalIndex, args.baseline_workers),
                                 ("packed (LocalIndex)", LocalIndex, args.workers)):
        copy = make()
        keep: list[bytes] = []
        seconds = fill(copy, fleet, workers, keep, rng)
        entries = len(copy)
        row = [label, workers, entries, footprint(copy) / entries, entries / seconds]
        if isinstance(copy, LocalIndex):
            copy._merge()  # the delta into the packed base, as the next merge would
            row.append(footprint(copy))
            for blocks in (128, 512):
                ms = lookups(copy, keep, blocks, args.lookups)
                row += [statistics.median(ms), percentile(ms, 99)]
        rows.append(row)
        del copy
    print(f"{'copy':<20} {'workers':>7} {'entries':>11} {'B/entry':>8} {'fill ev/s':>10} "
          f"{'B/entry merged':>14} {'128 p50/p99 ms':>15} {'512 p50/p99 ms':>15}")
    for row in rows:
        label, workers, entries, per, rate, *rest = row
        line = f"{label:<20} {workers:>7} {entries:>11,} {per:>8.1f} {rate:>10,.0f}"
        if rest:
            merged, p50a, p99a, p50b, p99b = rest
            line += (f" {merged / entries:>14.1f} {p50a:>7.3f}/{p99a:<7.3f}"
                     f" {p50b:>7.3f}/{p99b:<7.3f}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
