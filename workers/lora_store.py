"""Where a worker's LoRA adapters are: registered by name (the folder to read them from), held
in host memory (LRU, at most ``max_cpu_loras`` not in use), and in the batch's slots (LRU, at
most ``max_loras``), as vLLM bounds them.

Invariants:

- A step's adapters are all in slots. The scheduler admits at most ``max_loras`` distinct
  adapters among running sequences, and only a slot no running sequence uses is evicted.
- A queued or running request's adapter stays in host memory from its admission to its end,
  so a step never reads a file: a request's read happens before it queues, off the engine loop
  where the worker can (:meth:`LoRAStore.prefetch` is the one method safe on another thread).
- Adapters are keyed by identity (``name@digest``): a name read again with other weights is
  another adapter, and the requests admitted under the old weights finish under them.

On a CPU worker a slot and its host copy are one tensor (``.to`` the same device copies
nothing); there ``max_loras`` bounds only the adapters one step mixes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from prefixserve.workers.engine_types import LoRAStats
from prefixserve.workers.lora import AdapterError, LoRAAdapter

_LOAD_S_WEIGHT = 0.2  # of a new slot load in the smoothed load time


@dataclass(frozen=True)
class AdapterRef:
    """A request's adapter: enough to find its weights wherever they are."""

    name: str
    identity: str  # name@digest
    path: str


class LoRAStore:
    """One worker's adapters. ``read(name, path)`` reads a folder into host memory (raising
    AdapterError when it does not fit the model); ``in_use()`` names the adapters of every
    queued and running request (asked on the engine loop, when host memory is over its bound)."""

    def __init__(self, read: Callable[[str, str], LoRAAdapter], in_use: Callable[[], set[str]],
                 device: torch.device, max_loras: int, max_cpu_loras: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_cpu_loras < max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        self._read = read
        self._in_use = in_use
        self._clock = clock  # times slot loads
        self.device = device
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.known: dict[str, AdapterRef] = {}
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # by identity, oldest first
        self.slots: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()  # host and the read count: prefetch runs beside the loop
        self.loads = self.reads = self.evictions = 0
        self.load_s = 0.0  # smoothed seconds to put an adapter in a slot

    # ------------------------------------------------------------------ names and reads

    def prefetch(self, name: str, path: str, identity: str | None = None) -> LoRAAdapter:
        """The host copy of the adapter at ``path`` (of ``identity`` when given), read unless
        held. Safe on any thread; AdapterError when it does not fit, or when its files no
        longer hold ``identity``'s weights."""
        if identity is not None:
            with self._lock:
                held = self.host.get(identity)
            if held is not None:
                return held
        adapter = self._read(name, path)  # outside the lock: the engine loop goes on
        if identity is not None and adapter.identity != identity:
            raise AdapterError(f"the weights at {path} are now {adapter.identity}, "
                               f"not {identity}")
        with self._lock:
            self.reads += 1
            self.host[adapter.identity] = adapter
            self.host.move_to_end(adapter.identity)
        return adapter

    def register(self, name: str, path: str, identity: str | None = None) -> AdapterRef:
        """Serve the adapter at ``path`` as ``name`` (replacing the name's earlier weights for
        later requests); AdapterError, and nothing registered, when it does not fit."""
        adapter = self.prefetch(name, path, identity)
        ref = AdapterRef(name, adapter.identity, path)
        self.known[name] = ref
        self._trim_host()
        return ref

    def remove(self, name: str) -> None:
        """Admit no more requests under ``name``; its host copy goes unless requests use it."""
        ref = self.known.pop(name, None)
        if ref is not None and ref.identity not in self._in_use():
            with self._lock:
                self.host.pop(ref.identity, None)

    def hold(self, ref: AdapterRef) -> None:
        """Keep ``ref``'s weights in host memory for a request about to queue."""
        self.prefetch(ref.name, ref.path, ref.identity)

    # ------------------------------------------------------------------ the step

    def activate(self, needed: Iterable[str], running: Iterable[str],
                 ) -> Mapping[str, LoRAAdapter]:
        """The slot copies of a step's adapters (identities), each loaded from its host copy
        if not in a slot, into a free slot or the least recently used one no ``running``
        sequence uses."""
        keep = set(running)
        out: dict[str, LoRAAdapter] = {}
        for identity in needed:
            adapter = self.slots.get(identity)
            if adapter is None:
                adapter = self._load(identity, keep)
            self.slots.move_to_end(identity)
            out[identity] = adapter
        self._trim_host()
        return out

    def _load(self, identity: str, keep: set[str]) -> LoRAAdapter:
        start = self._clock()
        if len(self.slots) >= self.max_loras:
            victim = next(i for i in self.slots if i not in keep)  # the scheduler left one
            del self.slots[victim]
            self.evictions += 1
        with self._lock:
            host = self.host[identity]  # held since its request was admitted
            self.host.move_to_end(identity)
        adapter = host.to(self.device)
        self.slots[identity] = adapter
        self.loads += 1
        elapsed = self._clock() - start
        self.load_s = elapsed if self.loads == 1 else (
            _LOAD_S_WEIGHT * elapsed + (1 - _LOAD_S_WEIGHT) * self.load_s)
        return adapter

    def _trim_host(self) -> None:
        """Drop host copies past ``max_cpu_loras``, least recently used first, unless in use."""
        if len(self.host) <= self.max_cpu_loras:
            return
        in_use = self._in_use()
        with self._lock:
            for identity in [i for i in self.host if i not in in_use]:
                if len(self.host) <= self.max_cpu_loras:
                    break
                del self.host[identity]

    def stats(self) -> LoRAStats:
        return LoRAStats(len(self.known), self.max_loras, tuple(self.slots), self.loads,
                         self.reads, self.evictions, self.load_s)
