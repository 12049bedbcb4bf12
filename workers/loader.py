"""Load a Hugging Face Llama-family checkpoint: config.json + safetensors (single or sharded).

Reads both the transformers 4 layout (`rope_theta` / `rope_scaling` at the top level) and the
transformers 5 one (`rope_parameters` holding `rope_theta` and the scaling type). Weights stream
tensor by tensor from the safetensors files straight into the fused parameters of `CausalLM`
(q/k/v into one projection, gate/up into another), so no second copy of the model is built;
q/k rows are reordered per head for the model's complex-multiply RoPE (`interleave_rope_rows`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from workers.errors import UnsupportedModelError
from workers.model import CausalLM, interleave_rope_rows, to_dtype

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE = ("default", "llama3", "linear")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass
class ModelConfig:
    """The fields of config.json this engine uses, normalised across transformers versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # with "rope_type"; None for plain RoPE
    attention_bias: bool = False  # q/k/v projections carry a bias (always for Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # honoured by capping max_model_len (see below)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # config.json and generation_config.json together

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: sliding-window attention is not implemented, so a
        window shorter than the position limit caps the length (results stay exact)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def parse_config(raw: dict, generation: dict | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict (and optionally generation_config.json)."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if not archs:  # some hand-written configs name only the model_type
        arch = _MODEL_TYPES.get(raw.get("model_type", ""))
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {raw['hidden_act']!r}")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor is not supported")
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    eos = _ids(raw.get("eos_token_id"))
    for t in _ids((generation or {}).get("eos_token_id")):
        if t not in eos:
            eos += (t,)
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=sliding,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
    )


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse `<path>/config.json` (plus generation_config.json when present)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"missing {cfg_file}")
    gen_file = path / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return parse_config(json.loads(cfg_file.read_text()), generation)


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


def load_model(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> CausalLM:
    """Build `CausalLM` on `device` in `dtype` and fill it from the checkpoint at `path`."""
    config = load_model_config(path)
    files = weight_files(path)
    dtype = to_dtype(dtype)
    device = resolve_device(device)
    with torch.device("meta"):
        model = CausalLM(config, dtype=dtype)
    model.to_empty(device=device)
    model.finish_init()
    targets = _targets(model, config)
    filled: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name not in targets:
                    raise UnsupportedModelError(f"unexpected weight {name!r} in {file.name}")
                param, rows = targets[name]
                tensor = f.get_tensor(name)
                if ".q_proj." in name or ".k_proj." in name:
                    tensor = interleave_rope_rows(tensor, config.head_dim)
                dst = param.data if rows is None else param.data[rows]
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
                dst.copy_(tensor)
                filled.add(name)
    missing = sorted(set(targets) - filled)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(missing[:5])}")
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
