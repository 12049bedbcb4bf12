"""Load a checkpoint into its model class: a Hugging Face directory or a GGUF file.

Both sources are read as one stream of `(HF name, tensor)` pairs — safetensors files (single or
sharded) as they are, GGUF dequantized by `workers.gguf` — and each tensor goes straight into the
slot the model's `weight_map` names (for Llama, row slices of its fused q/k/v and gate/up
projections), so no second copy of the model is built. The registry picks the model class from
the config's architecture.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from prefixserve.workers.checkpoints import is_gguf, weight_files
from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.gguf import GGUFFile
from prefixserve.workers.models.base import CausalLM, to_dtype
from prefixserve.workers.models.config import ModelConfig, load_model_config
from prefixserve.workers.models.quantization import quantize_model
from prefixserve.workers.models.registry import Architecture, get_architecture

log = logging.getLogger(__name__)

WeightStream = Iterator[tuple[str, torch.Tensor]]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def safetensors_weights(path: str | Path) -> WeightStream:
    """Every tensor of a safetensors checkpoint, one file open at a time."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_model(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
    quantization: str = "none",
) -> CausalLM:
    """Build the model on `device` in `dtype` and fill it from the checkpoint at `path`; then
    quantize its linear layers unless `quantization` is "none"."""
    if is_gguf(path):
        gguf = GGUFFile(path)
        model = build_model(gguf.config, gguf.iter_tensors(), dtype, device, path)
    else:
        model = build_model(load_model_config(path), safetensors_weights(path), dtype, device,
                            path)
    if quantization != "none":
        ops = getattr(model, "ops", None)
        log.info("%s", quantize_model(model, quantization, dense=ops.dense if ops else None))
    return model


def architecture_class(architecture: Architecture) -> type[CausalLM]:
    """The architecture's model class, imported only when a model is built (it pulls in torch);
    here rather than in the registry, which the ingress reads and which must not know models."""
    module = importlib.import_module(f"prefixserve.workers.models.{architecture.module}")
    return getattr(module, architecture.class_name)


def build_model(
    config: ModelConfig,
    weights: WeightStream,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    source: str | Path = "checkpoint",
) -> CausalLM:
    """The model filled from a stream of HF-named tensors; every slot must be given."""
    dtype = to_dtype(dtype)
    model_class = architecture_class(get_architecture(config.architecture))
    with torch.device("meta"):
        model = model_class(config, dtype=dtype)
    model.to_empty(device=resolve_device(device))
    model.finish_init()
    slots = model.weight_map()
    filled: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in slots:
            raise UnsupportedModelError(f"unexpected weight {name!r} in {source}")
        slot = slots[name]
        if slot.prepare is not None:
            tensor = slot.prepare(tensor)
        dst = slot.param.data if slot.rows is None else slot.param.data[slot.rows]
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)
        filled.add(name)
    missing = sorted(set(slots) - filled)
    if missing:
        raise ValueError(f"{source} lacks weights: {', '.join(missing[:5])}")
    return model.eval()
