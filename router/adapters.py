"""A LoRA adapter's place in the cache key, shared by the workers and the router.

KV computed under an adapter is that adapter's: the same prompt under another adapter, or under
the base model, must never hit it. The adapter's identity (its name and a digest of its
weights) is folded into the model fingerprint that every block chain's namespace starts from,
so neither a client's `cache_salt` nor a tenant's salt can reach it, and an adapter whose
weights change is a new adapter. Torch-free.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def adapter_fingerprint(model_fingerprint: str, adapter: str | None) -> str:
    """The fingerprint a request's block chain is keyed by: the model's, or the model's under
    adapter `adapter` (its identity, `name@digest`)."""
    return model_fingerprint if adapter is None else f"{model_fingerprint}+lora:{adapter}"


WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's
CONFIG_FILE = "adapter_config.json"


def adapter_name(identity: str) -> str:
    """The name in an adapter's identity (`name@digest`)."""
    return identity.rsplit("@", 1)[0]


def adapter_digest(weights: bytes) -> str:
    """What tells two versions of an adapter apart: the first 16 hex characters of SHA-256
    over its weights file."""
    return hashlib.sha256(weights).hexdigest()[:16]


def adapter_identity(name: str, folder: str | Path) -> str:
    """`name@digest` of the adapter in `folder` (PEFT's layout), as the engine that loads it
    names it."""
    return f"{name}@{adapter_digest((Path(folder) / WEIGHTS_FILE).read_bytes())}"
