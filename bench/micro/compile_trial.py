"""Does torch.compile pay on the decode path? The trial behind the engine's choice not to use it.

    python -m prefixserve.bench.micro.compile_trial                         # bf16, no quantization
    python -m prefixserve.bench.micro.compile_trial --quantization int4

Each decoder layer's work outside attention is compiled (CPU inductor, dynamic shapes) from
torch's layer ops: before attention the residual add, the norm, the q/k/v projection and RoPE;
after it the o projection, the residual add, the norm and the MLP. Attention stays eager (its
plan is Python built once per step). Eager is the engine as it ships (on a CPU, its fused layer
ops). The two run in separate processes (a compiled layer stays patched): the first request's
time (the compiles), then a 512-token prompt's prefill and the median of its 128 decode steps,
one thread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from prefixserve.bench.load.machine import cpu_name
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.models import llama
from prefixserve.workers.models.layers import LayerOps

TORCH = LayerOps()  # what inductor traces


def _before_attention(layer: llama.DecoderLayer, x: torch.Tensor,
                      residual: torch.Tensor | None, cis: torch.Tensor):
    a = layer.self_attn
    if residual is None:
        residual, h = x, layer.input_layernorm(x, None, TORCH)
    else:
        h = layer.input_layernorm(x, residual, TORCH)
    qkv = a.qkv_proj(h).view(x.shape[0], -1, a.head_dim)
    heads, kvh = a.heads, a.kv_heads
    TORCH.rope_(qkv, cis, heads + kvh)
    return qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:], residual


def _after_attention(layer: llama.DecoderLayer, attn: torch.Tensor, residual: torch.Tensor):
    h = layer.post_attention_layernorm(layer.self_attn.o_proj(attn), residual, TORCH)
    return layer.mlp.down_proj(TORCH.silu_mul(layer.mlp.gate_up_proj(h)))


def compile_layers() -> None:
    """Patch every decoder layer to run its non-attention work compiled (LoRA-free)."""
    before = torch.compile(_before_attention, dynamic=True)
    after = torch.compile(_after_attention, dynamic=True)

    def forward(self, x, residual, step, k_cache, v_cache):
        q, k, v, residual = before(self, x, residual, step.angles)
        attn = step.backend.forward(q, k, v, k_cache, v_cache, step.meta, self.self_attn.scale)
        return after(self, attn, residual), residual

    llama.DecoderLayer.forward = forward


def run(mode: str, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    if mode == "compiled":
        compile_layers()
    engine = LLMEngine.from_pretrained(resolve_checkpoint(args.model), EngineConfig(
        dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False))
    if mode == "compiled":
        engine.model.ops = TORCH  # its RoPE angles and final norm, for the compiled layers
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    start = time.perf_counter()
    engine.generate([[rng.randrange(100, vocab) for _ in range(64)]],
                    SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first = time.perf_counter() - start
    engine.add_request("timed", [rng.randrange(100, vocab) for _ in range(512)],
                       SamplingParams(max_tokens=130, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    steps = []
    for _ in range(128):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return {"mode": mode, "first_request_s": round(first, 2),
            "prefill_tok_s": round(512 / prefill, 1),
            "decode_tok_s": round(1 / statistics.median(steps), 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="none", choices=("none", "int4", "int8"))
    p.add_argument("--mode", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:  # one side of the trial, in its own process
        print(json.dumps(run(args.mode, args)), flush=True)
        return
    print(json.dumps({"cpu": cpu_name(), "dtype": args.dtype,
                      "quantization": args.quantization}), flush=True)
    for mode in ("eager", "compiled"):
        subprocess.run([sys.executable, "-m", __spec__.name, "--model", args.model, "--dtype",
                        args.dtype, "--quantization", args.quantization, "--mode", mode],
                       check=True)


if __name__ == "__main__":
    main()
