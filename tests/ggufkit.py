"""Write small GGUF files from Hugging Face models, as llama.cpp's converter lays them out.

Test-side only: the names, the Q/K row permutation of `llama` files, the metadata keys, and
quantized tensors (gguf-py quantizes Q8_0 / Q4_0 / Q4_1 / F16 / BF16 itself; K-quant blocks are
written as random bytes with finite scales, so dequantizing them is checked against
transformers' own K-quant code).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from prefixserve.workers.byte_level import bytes_to_unicode

QK_K = 256
# Byte offsets of the fp16 scale fields in one 256-value block, and the block size in bytes.
K_BLOCKS = {
    GGMLQuantizationType.Q4_K: ((0, 2), 144),
    GGMLQuantizationType.Q5_K: ((0, 2), 176),
    GGMLQuantizationType.Q6_K: ((208,), 210),
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's rotate-half rows interleaved pairwise."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def k_quant_bytes(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random K-quant blocks for a [rows, cols] weight, scales set to small finite values."""
    scale_offsets, block_bytes = K_BLOCKS[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // QK_K, block_bytes), dtype=np.uint8)
    for off in scale_offsets:
        scales = rng.uniform(0.002, 0.01, size=len(blocks)).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // QK_K * block_bytes)


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """GPT-2's 256 byte characters, then two-letter tokens from merges ("a b" -> "ab")."""
    byte_chars = bytes_to_unicode()
    chars = [byte_chars[b] for b in range(256)]
    letters = "abcdefghijklmnop"
    pairs = [a + " " + b for a in letters for b in letters][: size - 256]
    return chars + [p.replace(" ", "") for p in pairs], pairs


def write_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    arch: str = "llama",
    qtypes: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """`hf_model` (Llama or Qwen2) as a GGUF; `qtypes` maps HF names to a quantization."""
    c = hf_model.config
    qtypes = qtypes or {}
    w = GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tokens, merges = byte_level_vocab(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    state = hf_model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i, (name, tensor) in enumerate(state.items()):
        array = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            array = permute(array, heads)
        qtype = qtypes.get(name, GGMLQuantizationType.F32)
        if qtype in K_BLOCKS:
            w.add_tensor(gguf_name(name), k_quant_bytes(array.shape, qtype, i), raw_dtype=qtype)
        elif qtype == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
        else:
            w.add_tensor(gguf_name(name), quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
