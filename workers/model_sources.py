"""Where a served model comes from, by the form of its ``--model`` value: one interface, one
registry.

A model is a checkpoint (a directory, a GGUF file, the built-in ``prefixserve-tiny``, a packaged
model) or ``sim:<profile>``, a simulated engine (docs/simulation.md). Everything that depends
on which (the config's validation, fingerprint and served name; the ingress's tokenizer, context
and vocabulary; the worker's engine) asks the model's source. A new kind is one
:class:`ModelSource` and one entry in :data:`MODEL_SOURCES`. Torch-free to import: an engine's
module is imported when one is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prefixserve.router.events import KVEvent
from prefixserve.router.registry import Registry
from prefixserve.workers import checkpoints
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.models.config import load_model_config
from prefixserve.workers.sim import profiles

if TYPE_CHECKING:
    from prefixserve.workers.engine_core import EngineCore

OnKVEvents = Callable[[list[KVEvent]], None]


class ModelSource(ABC):
    """What the cluster needs to know of a model, given its ``--model`` value."""

    @abstractmethod
    def check(self, model: str) -> str:
        """The value as the config keeps it; ValueError when it names nothing servable."""

    @abstractmethod
    def tokenizer_path(self, model: str) -> Path:
        """The checkpoint directory whose tokenizer (and chat template) the ingress reads."""

    @abstractmethod
    def limits(self, model: str, path: Path) -> tuple[int, int]:
        """The model's context length and the vocabulary its workers accept; ``path`` is
        :meth:`tokenizer_path`'s answer, so the checkpoint is resolved once."""

    @abstractmethod
    def fingerprint(self, model: str) -> str:
        """What block hashes are namespaced by: routers and engines use the same."""

    @abstractmethod
    def served_name(self, model: str) -> str:
        """The name clients send by default."""

    @abstractmethod
    def load_engine(self, model: str, config: EngineConfig,
                    on_kv_events: OnKVEvents) -> EngineCore:
        """The engine for ``model`` on this node."""


class CheckpointSource(ModelSource):
    """A real checkpoint, resolved on each node (paths differ between nodes; a GGUF is
    converted once per node)."""

    def check(self, model: str) -> str:
        if model == checkpoints.BUILTIN_MODEL_NAME:  # written on first use
            return model
        path = checkpoints.locate(model)
        return model if model in checkpoints.KNOWN_MODELS else str(path)

    def tokenizer_path(self, model: str) -> Path:
        return checkpoints.resolve_checkpoint(model)

    def limits(self, model: str, path: Path) -> tuple[int, int]:
        config = load_model_config(path)
        return config.max_model_len, config.vocab_size

    def fingerprint(self, model: str) -> str:
        return checkpoints.checkpoint_fingerprint(checkpoints.resolve_checkpoint(model))

    def served_name(self, model: str) -> str:
        return checkpoints.served_name(model)

    def load_engine(self, model: str, config: EngineConfig,
                    on_kv_events: OnKVEvents) -> EngineCore:
        from prefixserve.workers.engine import LLMEngine  # torch

        return LLMEngine.from_pretrained(checkpoints.resolve_checkpoint(model), config,
                                         on_kv_events)


class SimSource(ModelSource):
    """``sim:<profile>``: a simulated engine whose steps take the profile's modelled time, its
    token ids within the sim tokenizer's vocabulary."""

    def check(self, model: str) -> str:
        profiles.profile_for(model)  # an unknown profile: the error lists the known ones
        return model

    def tokenizer_path(self, model: str) -> Path:
        return checkpoints.resolve_checkpoint(profiles.TOKENIZER_MODEL)

    def limits(self, model: str, path: Path) -> tuple[int, int]:
        profile = profiles.profile_for(model)  # no checkpoint: the profile's
        return profile.max_model_len, profile.served_vocab_size

    def fingerprint(self, model: str) -> str:
        return profiles.profile_for(model).fingerprint

    def served_name(self, model: str) -> str:
        return profiles.served_name(model)

    def load_engine(self, model: str, config: EngineConfig,
                    on_kv_events: OnKVEvents) -> EngineCore:
        from prefixserve.workers.sim.engine import SimEngine

        profile = profiles.profile_for(model)
        return SimEngine(profile, config, on_kv_events, sleep=True,
                         vocab_size=profile.served_vocab_size)


# Name prefix -> source; the longest matching prefix wins, "" (checkpoints) matches any name.
MODEL_SOURCES: Registry[ModelSource] = Registry("model source", {
    profiles.SIM_PREFIX: SimSource(),
    "": CheckpointSource(),
})


def model_source(model: str) -> ModelSource:
    """The source of a ``--model`` value."""
    prefix = max((p for p in MODEL_SOURCES if model.startswith(p)), key=len)
    return MODEL_SOURCES[prefix]
