"""The architectures this engine serves, and what differs between them.

One entry per architecture, keyed by the name a Hugging Face config.json lists under
`architectures`. Entries are plain data, so reading a config (the ingress does, without torch)
needs no model code; the model class is imported from `workers.models.<module>` only when a
model is built, as vLLM's registry does. Adding an architecture means its module (the model
class, whose `weight_map` names the checkpoint tensors it takes) and one line in
`ARCHITECTURES`; a variant of an existing model needs the line only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixserve.router.registry import Registry
from prefixserve.workers.errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    """How one architecture's config reads and which class builds it."""

    name: str  # as config.json's `architectures` lists it
    model_type: str  # config.json's `model_type`
    module: str  # `workers.models.<module>` defines `class_name`
    class_name: str
    qkv_bias: bool = False  # q/k/v projections carry a bias whatever config.json says
    sliding_window_flag: str | None = None  # config key that must be true for `sliding_window`
    gguf_name: str | None = None  # GGUF `general.architecture`; None: not read from GGUF
    gguf_qk_permuted: bool = False  # llama.cpp's converter interleaved the Q/K rows per head


def _unsupported(name: object, supported: tuple[str, ...]) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported architecture {name!r}; supported: {', '.join(supported)}"
    )


ARCHITECTURES: Registry[Architecture] = Registry("architecture", {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "llama", "LlamaForCausalLM",
                     gguf_name="llama", gguf_qk_permuted=True),
        Architecture("MistralForCausalLM", "mistral", "llama", "LlamaForCausalLM"),
        Architecture("Qwen2ForCausalLM", "qwen2", "llama", "LlamaForCausalLM", qkv_bias=True,
                     sliding_window_flag="use_sliding_window", gguf_name="qwen2"),
    )
}, unknown=_unsupported)


def get_architecture(name: str) -> Architecture:
    """The entry for `name`; UnsupportedModelError naming it (and what is supported) if none."""
    return ARCHITECTURES.lookup(name)


def hf_architecture(raw: dict) -> Architecture:
    """The architecture of a config.json: its first supported `architectures` entry, or, for
    hand-written configs that list none, its `model_type`."""
    archs = raw.get("architectures") or []
    arch = next(
        (ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in ARCHITECTURES), None
    )
    if not archs:
        model_type = raw.get("model_type", "")
        arch = next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)
    if arch is None:
        raise _unsupported(archs or raw.get("model_type"), ARCHITECTURES.names())
    return arch


def gguf_architecture(gguf_name: Any) -> Architecture:
    """The architecture a GGUF file's `general.architecture` names (UnsupportedModelError if
    none reads from GGUF)."""
    by_name = Registry("GGUF architecture",
                       {a.gguf_name: a for a in ARCHITECTURES.values() if a.gguf_name},
                       unknown=_unsupported)
    return by_name.lookup(gguf_name)
