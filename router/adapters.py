"""A LoRA adapter's place in the cache key, shared by the workers and the router.

KV computed under an adapter is that adapter's: the same prompt under another adapter, or under
the base model, must never hit it. The adapter's identity (its name and a digest of its
weights) is folded into the model fingerprint that every block chain's namespace starts from,
so neither a client's `cache_salt` nor a tenant's salt can reach it, and an adapter whose
weights change is a new adapter. Torch-free.
"""

from __future__ import annotations


def adapter_fingerprint(model_fingerprint: str, adapter: str | None) -> str:
    """The fingerprint a request's block chain is keyed by: the model's, or the model's under
    adapter `adapter` (its identity, `name@digest`)."""
    return model_fingerprint if adapter is None else f"{model_fingerprint}+lora:{adapter}"
