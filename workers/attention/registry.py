"""Which attention backend serves a device."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from prefixserve.router.registry import Registry
from prefixserve.workers.attention.base import AttentionBackend
from prefixserve.workers.attention.cpu_paged import CPUPagedBackend
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend
from prefixserve.workers.kernels.build import cpu_kernels

# `PREFIXSERVE_ATTENTION_BACKEND` (as vLLM's VLLM_ATTENTION_BACKEND) forces one backend by name
# for the process and the Ray workers it starts; unset, or `auto`, lets the device choose.
BACKEND_ENV = "PREFIXSERVE_ATTENTION_BACKEND"


def _cpu() -> AttentionBackend:
    """The paged-decode kernel where this machine can build it, else torch SDPA."""
    kernel = cpu_kernels()
    return CPUPagedBackend(kernel) if kernel is not None else TorchSDPABackend()


def _cpu_paged() -> AttentionBackend:
    kernel = cpu_kernels()
    if kernel is None:
        raise RuntimeError(f"{BACKEND_ENV}=cpu_paged, but the CPU kernel could not be built "
                           "here (see the log line above)")
    return CPUPagedBackend(kernel)


# Device type -> backend factory. Paged GPU kernels register here (e.g. "cuda": a FlashInfer
# backend); a device type without an entry gets the default, torch SDPA, which runs anywhere.
Factory = Callable[[], AttentionBackend]
BACKENDS: Registry[Factory] = Registry(
    "attention backend", {"cpu": _cpu}, default=TorchSDPABackend)
BY_NAME: Registry[Factory] = Registry(
    "attention backend", {"torch_sdpa": TorchSDPABackend, "cpu_paged": _cpu_paged})


def backend_for(device: torch.device | str) -> AttentionBackend:
    """A backend instance for tensors on `device` (or the one `PREFIXSERVE_ATTENTION_BACKEND`
    names)."""
    forced = os.environ.get(BACKEND_ENV, "auto")
    if forced != "auto":
        return BY_NAME.lookup(forced)()
    return BACKENDS.lookup(torch.device(device).type)()
