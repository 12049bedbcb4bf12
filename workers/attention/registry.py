"""Which attention backend serves a device."""

from __future__ import annotations

import torch

from prefixserve.workers.attention.base import AttentionBackend
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend

# Device type -> backend. Paged GPU kernels register here (e.g. "cuda": a FlashInfer backend);
# a device type without an entry gets DEFAULT_BACKEND, torch SDPA, which runs wherever torch does.
BACKENDS: dict[str, type[AttentionBackend]] = {"cpu": TorchSDPABackend}
DEFAULT_BACKEND: type[AttentionBackend] = TorchSDPABackend


def backend_for(device: torch.device | str) -> AttentionBackend:
    """A backend instance for tensors on `device`."""
    return BACKENDS.get(torch.device(device).type, DEFAULT_BACKEND)()
