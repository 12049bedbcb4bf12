"""Load a Llama-family checkpoint into `CausalLM`: a Hugging Face directory or a GGUF file.

Both sources are read as one stream of `(HF name, tensor)` pairs — safetensors files (single or
sharded) as they are, GGUF dequantized by `workers.gguf` — and each tensor goes straight into the
fused parameters of `CausalLM` (q/k/v into one projection, gate/up into another), so no second
copy of the model is built; q/k rows are reordered per head for the model's complex-multiply
RoPE (`interleave_rope_rows`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from workers.checkpoints import is_gguf
from workers.errors import UnsupportedModelError
from workers.gguf import GGUFFile
from workers.model import CausalLM, interleave_rope_rows, to_dtype
from workers.model_config import ModelConfig, load_model_config

WeightStream = Iterator[tuple[str, torch.Tensor]]


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory or GGUF file."""
    return GGUFFile(path).config if is_gguf(path) else load_model_config(path)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, single-file or sharded via its index."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    elif single.is_file():
        files = [single]
    else:
        raise FileNotFoundError(f"missing {single} (or a sharded {index.name})")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing weight file {f}")
    return files


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
    path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> CausalLM:
    """Build `CausalLM` on `device` in `dtype` and fill it from the checkpoint at `path`."""
    if is_gguf(path):
        gguf = GGUFFile(path)
        return build_model(gguf.config, gguf.iter_tensors(), dtype, device, path)
    return build_model(load_model_config(path), safetensors_weights(path), dtype, device, path)


def build_model(
    config: ModelConfig,
    weights: WeightStream,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    source: str | Path = "checkpoint",
) -> CausalLM:
    """`CausalLM` filled from a stream of HF-named tensors; every parameter must be given."""
    dtype = to_dtype(dtype)
    with torch.device("meta"):
        model = CausalLM(config, dtype=dtype)
    model.to_empty(device=resolve_device(device))
    model.finish_init()
    targets = _targets(model, config)
    filled: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in targets:
            raise UnsupportedModelError(f"unexpected weight {name!r} in {source}")
        param, rows = targets[name]
        if ".q_proj." in name or ".k_proj." in name:
            tensor = interleave_rope_rows(tensor, config.head_dim)
        dst = param.data if rows is None else param.data[rows]
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)
        filled.add(name)
    missing = sorted(set(targets) - filled)
    if missing:
        raise ValueError(f"{source} lacks weights: {', '.join(missing[:5])}")
    return model.eval()


def _targets(model: CausalLM, c: ModelConfig) -> dict[str, tuple[torch.nn.Parameter, slice | None]]:
    """HF weight name -> (our parameter, row slice inside a fused parameter)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    inter = c.intermediate_size
    gate_up = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
    out = {
        "model.embed_tokens.weight": (model.embed_tokens.weight, None),
        "model.norm.weight": (model.norm.weight, None),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head.weight, None)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, None)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, None)
        out[p + "self_attn.o_proj.weight"] = (layer.self_attn.o_proj.weight, None)
        out[p + "mlp.down_proj.weight"] = (layer.mlp.down_proj.weight, None)
        for n, rows in qkv_rows.items():
            out[p + f"self_attn.{n}_proj.weight"] = (layer.self_attn.qkv_proj.weight, rows)
            if c.attention_bias:
                out[p + f"self_attn.{n}_proj.bias"] = (layer.self_attn.qkv_proj.bias, rows)
        for n, rows in gate_up.items():
            out[p + f"mlp.{n}_proj.weight"] = (layer.mlp.gate_up_proj.weight, rows)
    return out
