"""The one shape of every variation point's registry: a table from name to entry, with a lookup
whose error names what was asked and everything known.

The registries: routing policies (`router.routing_policies`), index stores by URL scheme
(`router.index_stores`), model architectures (`workers.models.registry`), attention backends and
layer ops by device type (`workers.attention.registry`, `workers.models.layers`), model sources
by name prefix (`workers.model_sources`) and simulation profiles (`workers.sim.profiles`). Each
has a small base interface beside it that its entries implement. A plain ``dict`` underneath, so
a test may add an entry for its length (``monkeypatch.setitem``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# (the name asked for, the names known) -> the exception a failed lookup raises
Unknown = Callable[[object, tuple[str, ...]], Exception]


class Registry(dict[str, T]):
    """``kind``: what an entry is; ``unknown``: the error of a failed lookup (a ValueError
    naming the kind by default); ``default``: the entry of a name nothing is registered for
    (None: an unknown name is an error)."""

    def __init__(self, kind: str = "entry", entries: dict[str, T] | None = None, *,
                 unknown: Unknown | None = None, default: T | None = None) -> None:
        super().__init__(entries or {})
        self.kind = kind
        self.unknown = unknown
        self.default = default

    def lookup(self, name: object) -> T:
        """The entry for ``name`` (or the default); else the error, naming the known ones."""
        if isinstance(name, str) and name in self:
            return self[name]
        if self.default is not None:
            return self.default
        if self.unknown is not None:
            raise self.unknown(name, self.names())
        raise ValueError(f"unknown {self.kind} {name!r} (known: {', '.join(self)})")

    def names(self) -> tuple[str, ...]:
        return tuple(self)
