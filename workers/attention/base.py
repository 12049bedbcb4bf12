"""The attention backend interface: one layer's paged attention over the KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from prefixserve.workers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged prefill and decode for one layer, as the model calls it.

    A backend may precompute what every layer of a step shares (index tensors, masks, a
    kernel's plan) on the first call and keep it in `meta.backend_state`.
    """

    name: str  # as PREFIXSERVE_ATTENTION_BACKEND names it, and as the worker's start-up log says

    def prepare(self, dtype: torch.dtype) -> None:  # noqa: B027 (most backends need nothing)
        """What the backend measures or builds for the model's dtype, done at start rather than
        in the first step."""

    def kv_layout(self, dtype: torch.dtype, block_size: int, head_dim: int, heads: int,
                  kv_heads: int) -> str:
        """How K and V are ordered within a block, one of `attention.layouts.LAYOUTS`: `rows`
        (position-major, as the tensor's shape reads) unless the backend reads them otherwise.
        Whole blocks move the same in any order; a KV file on disk holds them position-major."""
        return "rows"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v [T, kvh, D] at `meta.slot_mapping`, attend q [T, H, D]; returns [T, H * D].

        k_cache / v_cache are one layer's [num_blocks, block_size, kvh, D] views of the KV
        tensor. A sequence with several new rows (a prefill chunk) attends causally over its
        cached prefix and itself; one with a single new row (decode) over its whole context.
        """
