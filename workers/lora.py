"""LoRA adapters on the base model: PEFT's layout read and checked, and the per-step batch that
applies each row's adapter, so requests under different adapters and the base model share one
forward pass.

An adapter adds `B·A·x·scale` to a projection's output (`scale` is `lora_alpha / r`, or
`lora_alpha / sqrt(r)` with rsLoRA), on any of q, k, v, o, gate, up and down. The model fuses
q/k/v and gate/up into one matmul each, so an adapter's A matrices for them are stacked (their
ranks side by side) and its B matrices placed block-diagonally at the fused rows, with q and k's
rows reordered as the base weights are (RoPE pairs side by side): one pair of small matmuls per
fused projection. The scale is folded into B once, at load.

In a step, the rows of each adapter present are gathered, run through its two matrices, and
added back (`index_add_`): the grouped form of punica's and S-LoRA's batched LoRA, with one
group per adapter in the step. A step without adapters does nothing extra.

An adapter's identity (its name and a digest of its weights) is part of its requests' cache
namespace (router/adapters.py), so two adapters never share KV.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from prefixserve.router.adapters import CONFIG_FILE, WEIGHTS_FILE, adapter_digest
from prefixserve.workers.models.config import ModelConfig
from prefixserve.workers.models.layers import interleave_rope_rows

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's tensor names for a Llama-family model wrapped in PeftModel
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+_proj)\.lora_([AB])\.weight")
Pair = tuple[torch.Tensor, torch.Tensor]  # A [rank, in], B [out, rank] with the scale folded in


class AdapterError(ValueError):
    """The adapter cannot be served on this model (the message says why); nothing was loaded."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights per decoder layer, by fused projection: `qkv`, `o`, `gate_up`,
    `down` (a projection it does not touch is absent)."""

    name: str
    digest: str  # of the weights file: a changed adapter is another adapter
    rank: int
    layers: list[dict[str, Pair]]

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.digest}"

    def to(self, device: torch.device) -> LoRAAdapter:
        """The adapter with its tensors on ``device`` (itself when they are there already)."""
        layers = [{part: (a.to(device), b.to(device)) for part, (a, b) in layer.items()}
                  for layer in self.layers]
        return LoRAAdapter(self.name, self.digest, self.rank, layers)


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, inter = c.hidden_size, c.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _read_config(folder: Path, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale, once its config is one this engine serves exactly."""
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder / CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is unreadable: {exc}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save")
                   if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterError(f"unsupported adapter settings: {', '.join(unsupported)}")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError("adapter_config.json needs an integer r >= 1 and a lora_alpha")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is over this server's max_lora_rank {max_rank}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scale


def load_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_rank: int) -> LoRAAdapter:
    """An adapter in PEFT's layout (`adapter_config.json`, `adapter_model.safetensors`), checked
    against this model: every tensor a known projection's, of its shape, in an existing layer
    (an adapter of another base model fails here), rank within `max_rank`."""
    folder = Path(path).expanduser()
    rank, scale = _read_config(folder, max_rank)
    file = folder / WEIGHTS_FILE
    try:
        raw = file.read_bytes()  # read once: the tensors and the digest come from it
        tensors = load(raw)
    except FileNotFoundError:
        raise AdapterError(f"{file} is missing") from None
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is unreadable: {exc}") from None
    shapes = projection_shapes(config)
    found: list[dict[str, dict[str, torch.Tensor]]] = [
        {} for _ in range(config.num_hidden_layers)]
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in shapes:
            raise AdapterError(f"tensor {key} is not a LoRA weight of a Llama-family "
                               f"projection ({', '.join(TARGETS)})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_hidden_layers:
            raise AdapterError(f"tensor {key}: this model has {config.num_hidden_layers} layers")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"tensor {key} has shape {tuple(tensor.shape)}, this model needs "
                               f"{want}: an adapter of another base model?")
        found[layer].setdefault(module, {})[which] = tensor
    for layer, modules in enumerate(found):
        for module, ab in modules.items():
            if len(ab) != 2:
                raise AdapterError(f"layer {layer} {module} has lora_{''.join(ab)} only")
    if not any(found):
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    layers = [_fuse(modules, config, scale, dtype, device) for modules in found]
    return LoRAAdapter(name, adapter_digest(raw), rank, layers)


def _fuse(modules: dict[str, dict[str, torch.Tensor]], c: ModelConfig, scale: float,
          dtype: torch.dtype, device: torch.device) -> dict[str, Pair]:
    """One layer's modules as the model's fused projections (see the module docstring)."""
    q, kv, inter = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                    c.intermediate_size)
    rope = {"q_proj", "k_proj"}
    groups = {"qkv": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
              "o": [("o_proj", 0, c.hidden_size)],
              "gate_up": [("gate_proj", 0, inter), ("up_proj", inter, inter)],
              "down": [("down_proj", 0, c.hidden_size)]}
    out: dict[str, Pair] = {}
    for fused, parts in groups.items():
        present = [(m, start, rows) for m, start, rows in parts if m in modules]
        if not present:
            continue
        width = parts[-1][1] + parts[-1][2]
        a = torch.cat([modules[m]["A"].float() for m, _, _ in present])
        b = torch.zeros(width, a.shape[0])
        col = 0
        for m, start, rows in present:
            block = modules[m]["B"].float() * scale
            if m in rope:
                block = interleave_rope_rows(block, c.head_dim)
            r = modules[m]["A"].shape[0]
            b[start:start + rows, col:col + r] = block
            col += r
        out[fused] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    return out


@dataclass
class LoRABatch:
    """A step's adapters: each with the rows (of the step's flat tokens) it applies to; None
    when it applies to every row."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = field(default_factory=list)

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, part: str) -> torch.Tensor:
        """`out += B·A·x` for each group's rows, in place; returns `out`."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(part)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                out.add_((x @ a.T) @ b.T)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return out

    @classmethod
    def of(cls, adapters: Seq[LoRAAdapter | None], counts: Seq[int],
           device: torch.device) -> LoRABatch | None:
        """The batch for sequences with `adapters` and `counts` rows each, in row order; None
        when no sequence has an adapter."""
        if not any(a is not None for a in adapters):
            return None
        rows: dict[str, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for adapter, n in zip(adapters, counts, strict=True):
            if adapter is not None:
                rows.setdefault(adapter.identity, (adapter, []))[1].extend(
                    range(start, start + n))
            start += n
        total = start
        return cls([(adapter, None if len(r) == total else
                     torch.tensor(r, dtype=torch.long, device=device))
                    for adapter, r in rows.values()])
