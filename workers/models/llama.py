"""Llama-family causal LM (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA/MQA, SwiGLU.

Mistral and Qwen2 differ from Llama only in their configs (see `workers.models.registry`). q/k/v
and gate/up are fused into one matmul each (`weight_map` sends the checkpoint's separate tensors
to row slices), RoPE is applied to q and k in one op, and attention goes through the paged KV
cache with the backend chosen for the model's device (`workers.attention.registry`). The norms,
RoPE, activation and the calls of the linear layers go through the device's `LayerOps`; a
sublayer's output joins the residual stream inside the next norm (`add_rms_norm_`), so the stream
travels beside each layer's output rather than being added into it. Only the rows in
`meta.logits_indices` reach the final norm and the LM head. A step's LoRA adapters
(`workers.lora.LoRABatch`) add to each projection's output for their rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from prefixserve.workers.attention.registry import backend_for
from prefixserve.workers.models.base import CausalLM, WeightSlot, to_dtype
from prefixserve.workers.models.layers import (
    LayerOps,
    RMSNorm,
    interleave_rope_rows,
    layer_ops_for,
    rope_inv_freq,
)

if TYPE_CHECKING:
    from prefixserve.workers.attention.base import AttentionBackend
    from prefixserve.workers.attention.metadata import AttentionMetadata
    from prefixserve.workers.lora import LoRABatch
    from prefixserve.workers.models.config import ModelConfig


@dataclass
class LayerInputs:
    """What every layer of one step shares."""

    angles: Any  # RoPE's, for the step's positions, in the form `ops.rope_` takes
    meta: AttentionMetadata
    backend: AttentionBackend
    ops: LayerOps
    lora: LoRABatch | None


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, index: int):
        super().__init__()
        self.index = index  # the layer's: which of an adapter's weights apply
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, width, bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, step: LayerInputs, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        lora = step.lora
        qkv = step.ops.linear(self.qkv_proj, x)
        if lora is not None:
            lora.apply(qkv, x, self.index, "qkv")
        qkv = qkv.view(x.shape[0], -1, self.head_dim)
        h, kvh = self.heads, self.kv_heads
        step.ops.rope_(qkv, step.angles, h + kvh)
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        attn = step.backend.forward(q, k, v, k_cache, v_cache, step.meta, self.scale)
        out = step.ops.linear(self.o_proj, attn)
        return out if lora is None else lora.apply(out, attn, self.index, "o")


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, index: int):
        super().__init__()
        self.index = index
        self.gate_up_proj = nn.Linear(
            c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype
        )
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, step: LayerInputs) -> torch.Tensor:
        lora = step.lora
        gate_up = step.ops.linear(self.gate_up_proj, x)
        if lora is not None:
            lora.apply(gate_up, x, self.index, "gate_up")
        act = step.ops.silu_mul(gate_up)
        out = step.ops.linear(self.down_proj, act)
        return out if lora is None else lora.apply(out, act, self.index, "down")


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, dtype, index)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype, index)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: LayerInputs,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it is added); at the first layer x is
        the embeddings and there is no stream yet."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, None, step.ops)
        else:
            h = self.input_layernorm(x, residual, step.ops)
        attn = self.self_attn(h, step, k_cache, v_cache)
        return self.mlp(self.post_attention_layernorm(attn, residual, step.ops), step), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, dtype: str | torch.dtype = torch.float32):
        super().__init__()
        dtype = to_dtype(dtype)
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        self.inv_freq = torch.empty(0)
        self.finish_init()

    def finish_init(self) -> None:
        """Tie embeddings, pick (and prepare) the attention backend and compute RoPE frequencies
        for the parameters' device."""
        device = self.embed_tokens.weight.device
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.attention = backend_for(device)
        self.ops = layer_ops_for(device, self.dtype)
        if device.type != "meta":
            self.attention.prepare(self.dtype)
            self.inv_freq = rope_inv_freq(self.config).to(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Run the step's T flat tokens, each row under its LoRA adapter if any; logits
        [len(logits_indices), vocab] in float32."""
        step = LayerInputs(self.ops.rope_angles(positions, self.inv_freq), meta, self.attention,
                           self.ops, lora)
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, step, kv_cache[i, 0], kv_cache[i, 1])
        rows = meta.logits_indices
        x = self.norm(x.index_select(0, rows), residual.index_select(0, rows), self.ops)
        return self.ops.linear(self.lm_head, x).float()

    def weight_map(self) -> dict[str, WeightSlot]:
        """HF names -> our parameters; q/k/v and gate/up land in row slices of the fused ones,
        q/k rows reordered for `apply_rope`."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        inter = c.intermediate_size
        gate_up = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
        rope_rows = partial(interleave_rope_rows, head_dim=c.head_dim)
        out = {
            "model.embed_tokens.weight": WeightSlot(self.embed_tokens.weight),
            "model.norm.weight": WeightSlot(self.norm.weight),
        }
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = WeightSlot(self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            out[p + "input_layernorm.weight"] = WeightSlot(layer.input_layernorm.weight)
            out[p + "post_attention_layernorm.weight"] = WeightSlot(
                layer.post_attention_layernorm.weight
            )
            out[p + "self_attn.o_proj.weight"] = WeightSlot(attn.o_proj.weight)
            out[p + "mlp.down_proj.weight"] = WeightSlot(layer.mlp.down_proj.weight)
            for n, rows in qkv_rows.items():
                prepare = rope_rows if n in ("q", "k") else None
                out[p + f"self_attn.{n}_proj.weight"] = WeightSlot(
                    attn.qkv_proj.weight, rows, prepare
                )
                if c.attention_bias:
                    out[p + f"self_attn.{n}_proj.bias"] = WeightSlot(
                        attn.qkv_proj.bias, rows, prepare
                    )
            for n, rows in gate_up.items():
                out[p + f"mlp.{n}_proj.weight"] = WeightSlot(layer.mlp.gate_up_proj.weight, rows)
        return out
