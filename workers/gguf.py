"""Read a llama.cpp GGUF checkpoint: its metadata, its model config, its weights in HF layout.

A GGUF file holds one model: metadata (architecture, shapes, tokenizer, chat template) and
tensors, most of them quantized in blocks. This module turns both into what the rest of the
engine already speaks — a `ModelConfig` and a stream of `(Hugging Face name, float32 tensor)` —
so one loader fills the model from safetensors and GGUF alike.

Two layout facts (llama.cpp's `convert_hf_to_gguf.py`):
* For the `llama` architecture the Q and K projection rows of every head are permuted from HF's
  rotate-half order to adjacent pairs; `iter_tensors` undoes that, so the tensors it yields are
  exactly the Hugging Face checkpoint's. `qwen2` files are not permuted (the registry's
  `gguf_qk_permuted` says which are).
* GGUF lists dimensions innermost first; `gguf.quants.dequantize` returns numpy's order
  (outermost first), which is torch's too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, quants

from prefixserve.workers.errors import UnsupportedModelError
from prefixserve.workers.models.config import ModelConfig
from prefixserve.workers.models.registry import gguf_architecture

# The quantizations served (dequantized at load into the engine's dtype).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n]
    for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-frequency divisors


class GGUFError(UnsupportedModelError):
    """A GGUF file that cannot be served: truncated, another architecture, a quantization."""


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors the engine derives itself."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of Q/K rows: back to HF's rotate-half order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(
        w.shape
    )


class GGUFFile:
    """One GGUF file, memory-mapped; every failure names the file and the reason."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"missing {self.path}")
        try:
            self.reader = GGUFReader(self.path)
        except Exception as exc:  # truncated or not a GGUF: numpy / struct / value errors
            raise GGUFError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self.arch = self.get("general.architecture")
        try:
            self.architecture = gguf_architecture(self.arch)
        except UnsupportedModelError as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {t.name} has unsupported quantization "
                    f"{t.tensor_type.name}; supported: "
                    f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))}"
                )

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as plain Python (str, int, float, bool or a list of them)."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        if field.types and field.types[0] == GGUFValueType.ARRAY and not field.data:
            return []
        return field.contents()

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    @cached_property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.reader.tensors)

    @cached_property
    def config(self) -> ModelConfig:
        """The model config, from the metadata alone (and which tensors exist)."""
        try:
            heads = int(self._arch("attention.head_count"))
            hidden = int(self._arch("embedding_length"))
            head_dim = int(self._arch("attention.key_length", hidden // heads))
            rope_dim = int(self._arch("rope.dimension_count", head_dim))
            kv_heads = int(self._arch("attention.head_count_kv", heads))
            vocab = self._arch("vocab_size") or len(self.get("tokenizer.ggml.tokens", []))
            config = ModelConfig(
                architecture=self.architecture.name,
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=int(self._arch("feed_forward_length")),
                num_hidden_layers=int(self._arch("block_count")),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(self._arch("context_length", 2048)),
                rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
                rope_theta=float(self._arch("rope.freq_base", 10000.0)),
                rope_scaling=self._rope_scaling(),
                attention_bias="blk.0.attn_q.bias" in self.tensor_names,
                tie_word_embeddings="output.weight" not in self.tensor_names,
                bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=self._eos_ids(),
            )
        except (TypeError, ValueError) as exc:
            raise GGUFError(f"{self.path}: incomplete {self.arch} metadata ({exc})") from None
        if rope_dim != head_dim:
            raise GGUFError(f"{self.path}: partial rotary ({rope_dim} of {head_dim}) unsupported")
        if heads % kv_heads:
            raise GGUFError(f"{self.path}: {heads} heads is not a multiple of {kv_heads} kv heads")
        return config

    def _rope_scaling(self) -> dict | None:
        kind = self._arch("rope.scaling.type")
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._arch("rope.scaling.factor"))}
        if ROPE_FREQS in self.tensor_names:
            factors = self._dequantize(ROPE_FREQS).tolist()
            return {"rope_type": "freq_factors", "factors": factors}
        if kind not in (None, "none"):
            raise GGUFError(f"{self.path}: unsupported rope scaling {kind!r}")
        return None

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.get(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        return tuple(ids)

    def _dequantize(self, name: str) -> np.ndarray:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        return quants.dequantize(tensor.data, tensor.tensor_type)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight as (HF name, float32 tensor in HF layout), one at a time."""
        c = self.config
        permuted = self.architecture.gguf_qk_permuted
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                if t.name == ROPE_FREQS:
                    continue
                raise GGUFError(f"{self.path}: unexpected tensor {t.name!r}")
            try:
                array = quants.dequantize(t.data, t.tensor_type)
            except Exception as exc:
                raise GGUFError(f"{self.path}: tensor {t.name} unreadable ({exc})") from None
            # F32 tensors come back as read-only views of the mapped file: copy those.
            array = np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
            tensor = torch.from_numpy(array)
            if permuted and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = c.num_attention_heads if "attn_q" in t.name else c.num_key_value_heads
                tensor = unpermute_rope_rows(tensor, heads)
            yield name, tensor
