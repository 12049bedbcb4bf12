"""The models one ingress serves: the base model and its LoRA adapters, by the names clients
put in `model`.

An adapter is known by its identity (`name@digest`, computed from its weights file, which the
workers check and the router hashes prompts under) and by the folder a worker loads it from,
which lets an adapter loaded at run time reach each worker with its first request there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.responses import ModelCard


@dataclass(frozen=True)
class Adapter:
    name: str  # what clients put in `model`
    identity: str  # name@digest
    path: str | None  # where a worker loads it from


@dataclass
class ServedModels:
    name: str  # the base model's served name
    max_model_len: int
    created: int
    adapters: dict[str, Adapter] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [self.name, *self.adapters]

    def card(self, name: str) -> ModelCard:
        """The model's card; an adapter's names the base model as its `parent`."""
        parent = None if name == self.name else self.name
        return ModelCard(id=name, created=self.created, max_model_len=self.max_model_len,
                         parent=parent)

    def resolve(self, model: str | None) -> Adapter | None:
        """The adapter `model` names, None for the base model (or no name); a 404 otherwise."""
        if model is None or model == self.name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        served = ", ".join(f"`{m}`" for m in self.names())
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"{served}.", param="model", code="model_not_found")

    def check_free(self, name: str) -> None:
        """A 400 when `name` is taken: a loaded adapter is never replaced under its name."""
        if name in self.names():
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")

    def add(self, adapter: Adapter) -> None:
        self.check_free(adapter.name)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name", code="model_not_found")
