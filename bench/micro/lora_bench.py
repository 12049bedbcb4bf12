"""LoRA's cost in the engine: throughput of a batch whose requests run under K adapters, against
the same batch on the base model alone, for adapters of rank 8 and 16 on all seven projections.

    python -m prefixserve.bench.micro.lora_bench            # the default real model
    python -m prefixserve.bench.micro.lora_bench --quick    # fewer requests and rounds

The adapters are random, written in PEFT's layout into a temporary folder. Every request
prefills its prompt and decodes a fixed number of tokens greedily (EOS ignored), so both
batches do the same work but the adapters'; the two alternate (base, adapters, base, ...) and
the median of each and their ratio are printed: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixserve.bench.load.machine import cpu_name
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.lora import TARGETS, projection_shapes
from prefixserve.workers.models.config import ModelConfig, load_model_config


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A random adapter on every projection of every layer, in PEFT's layout."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in projection_shapes(config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_"
            tensors[key + "A.weight"] = 0.01 * torch.randn(rank, fan_in, generator=gen)
            tensors[key + "B.weight"] = 0.01 * torch.randn(fan_out, rank, generator=gen)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS)}))
    return folder


def _run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams,
         loras: list[str | None]) -> float:
    """Generated tokens per second for the batch."""
    eng.reset_prefix_cache()
    start = time.perf_counter()
    outs = eng.generate(prompts, params, lora=loras)
    seconds = time.perf_counter() - start
    return sum(len(o.samples[0].token_ids) for o in outs) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4, help="K distinct adapters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.max_tokens = 8, 2, 32
    logging.basicConfig(level=logging.WARNING)
    path = resolve_checkpoint(args.model)
    config = load_model_config(path)
    eng = LLMEngine.from_pretrained(path, EngineConfig(device="cpu", max_num_seqs=64))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, config.vocab_size - 100, (args.prompt_tokens,),
                             generator=gen).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"model {args.model} on {platform.machine()} {cpu_name()}; {args.requests} requests "
          f"of {args.prompt_tokens} prompt tokens, {args.max_tokens} generated, "
          f"{args.adapters} adapters on all 7 projections, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for rank in (8, 16):
            names = []
            for k in range(args.adapters):
                name = f"r{rank}-{k}"
                eng.add_lora(name, write_adapter(Path(tmp) / name, config, rank, seed=k))
                names.append(name)
            mixed = [names[i % len(names)] for i in range(len(prompts))]
            rates: dict[str, list[float]] = {"base": [], "adapters": []}
            _run(eng, prompts, params, mixed)  # warm-up
            for _ in range(args.rounds):
                rates["base"].append(_run(eng, prompts, params, [None] * len(prompts)))
                rates["adapters"].append(_run(eng, prompts, params, mixed))
            base, lora = statistics.median(rates["base"]), statistics.median(rates["adapters"])
            print(f"rank {rank}: generated tok/s (median of {args.rounds}): base {base:.1f}, "
                  f"{args.adapters} adapters {lora:.1f}; ratio {lora / base:.3f} "
                  f"(overhead {1 - lora / base:+.1%})")
            for name in names:
                eng.remove_lora(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
