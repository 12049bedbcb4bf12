"""The model's shape and conventions (`ModelConfig`), read from a Hugging Face config.json.

Reads both the transformers 4 layout (`rope_theta` / `rope_scaling` at the top level) and the
transformers 5 one (`rope_parameters` holding `rope_theta` and the scaling type); what differs
per architecture (Qwen2's q/k/v biases, its sliding-window flag) comes from the registry. Pure
JSON: the ingress reads a checkpoint's config through here without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.models.registry import get_architecture, hf_architecture

# freq_factors: per-frequency divisors, as GGUF files store llama3-style scaling.
SUPPORTED_ROPE = ("default", "llama3", "linear", "freq_factors")


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
    arch = hf_architecture(raw)
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
    if arch.sliding_window_flag and not raw.get(arch.sliding_window_flag, False):
        sliding = None
    eos = _ids(raw.get("eos_token_id"))
    for t in _ids((generation or {}).get("eos_token_id")):
        if t not in eos:
            eos += (t,)
    return ModelConfig(
        architecture=arch.name,
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
        attention_bias=arch.qkv_bias or bool(raw.get("attention_bias", False)),
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


def to_hf_config(c: ModelConfig) -> dict:
    """A config.json for `c` that transformers and `parse_config` both read back to `c`."""
    raw = {k: v for k, v in asdict(c).items() if k not in ("architecture", "eos_token_ids")}
    model_type = get_architecture(c.architecture).model_type
    raw.update(architectures=[c.architecture], model_type=model_type, hidden_act="silu",
               eos_token_id=list(c.eos_token_ids), torch_dtype="float32")
    if c.sliding_window is None:
        raw.pop("sliding_window")
    return raw
