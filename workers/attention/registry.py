"""Which attention backend serves a device."""

from __future__ import annotations

import torch

from prefixserve.router.registry import Registry
from prefixserve.workers.attention.base import AttentionBackend
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend

# Device type -> backend. Paged GPU kernels register here (e.g. "cuda": a FlashInfer backend);
# a device type without an entry gets the default, torch SDPA, which runs wherever torch does.
BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend", {"cpu": TorchSDPABackend}, default=TorchSDPABackend)


def backend_for(device: torch.device | str) -> AttentionBackend:
    """A backend instance for tensors on `device`."""
    return BACKENDS.lookup(torch.device(device).type)()
