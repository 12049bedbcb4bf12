"""What every model class offers the loader and the engine, and the dtype names they accept."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from prefixserve.workers.attention.metadata import AttentionMetadata
    from prefixserve.workers.lora import LoRABatch
    from prefixserve.workers.models.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: a parameter, or some rows of a fused one."""

    param: nn.Parameter
    rows: slice | None = None  # None: the whole parameter
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied before the copy


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over the paged KV cache.

    The loader builds it on the meta device, gives the parameters storage, calls `finish_init`,
    then copies each checkpoint tensor into the slot `weight_map` names for it.
    """

    config: ModelConfig

    @abstractmethod
    def finish_init(self) -> None:
        """Set up what depends on the parameters' device (tied weights, tables, backends)."""

    @abstractmethod
    def weight_map(self) -> dict[str, WeightSlot]:
        """Hugging Face tensor name -> its slot; every name must be filled from the checkpoint."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Run the step's T flat tokens (each row under its LoRA adapter, if any); logits
        [len(logits_indices), vocab] in float32."""
