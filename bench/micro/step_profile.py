"""Where an engine step's time goes, against the floor the bytes it reads and its arithmetic
set.

    python -m prefixserve.bench.micro.step_profile                       # fp32, 1 thread
    python -m prefixserve.bench.micro.step_profile --dtype bfloat16 --batch 1,8,32
    python -m prefixserve.bench.micro.step_profile --dtype bfloat16 --quantization int4
    python -m prefixserve.bench.micro.step_profile --layer-ops torch     # the unfused baseline
    python -m prefixserve.bench.micro.step_profile --small-linear-rows 0 # every matmul by BLAS
    python -m prefixserve.bench.micro.step_profile --batch 32,32 --prefix-caching  # a used pool

One request of ``--prompt`` tokens is prefilled in one step and decoded for ``--decode`` steps
(greedy, EOS ignored); then ``--batch`` sizes decode together. Each step is timed as it runs
(the tok/s figures). Then one decode and one prefill step of a single stream, and one decode
step of the largest batch, run with every
part of the step wrapped in a timer, each part's own time (its inner parts' taken out): the
matmuls of the layers (q/k/v, o, gate/up, down), the LM head, attention (the backend), the rest
of the attention layer (RoPE, views), the MLP's activation, the norms, the rest of the model
(embedding, RoPE angles, the layer loop), the attention metadata, sampling, scheduling, and
the rest of the engine's step. All but the matmuls, the LM head and attention is the step's
host overhead.

The floor: a decode step reads every weight once (the embedding table only by row, unless the
LM head shares it) and every running sequence's cached K/V once, so its time is at least those
bytes over the machine's memory bandwidth, measured here as one thread summing a buffer larger
than the caches. ``decode_floor_ms`` is the weights' part for one stream. A batch's rows also
cost arithmetic, at one thread's rate on a large dense product in the model's dtype (the faster
of torch's and oneDNN's packed one), measured here: many streams make the matmuls
compute-bound, first on a CPU without fast bf16 (fp32 on AVX2).
So a batch's ``floor_matmuls_ms`` is the larger of its weights' bytes time and its matmul
FLOPs' time, its ``floor_attention_ms`` the same for its K/V at the mean context of its timed
steps and attention's FLOPs, and its ``floor_ms`` their sum (the two run one after the other).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from prefixserve.bench.load.machine import cpu_name
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.kv_tensor import kv_bytes_per_token
from prefixserve.workers.models import packed_linear
from prefixserve.workers.models.layers import CPULayerOps, LayerOps
from prefixserve.workers.models.packed_linear import PackedWeights
from prefixserve.workers.models.quantization import QuantizedLinear

HOST = ("attention layer other", "mlp activation", "norms", "model other", "metadata",
        "sampling", "scheduling", "engine other")


def read_bandwidth_gb_s(mib: int = 512, reps: int = 5) -> float:
    """One thread's read bandwidth over a buffer far larger than the caches (a sum reads every
    byte once): what streaming the weights can reach."""
    buf = torch.ones(mib << 18, dtype=torch.float32)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(reps))
    return buf.nbytes / best / 1e9


def matmul_gflop_s(engine: LLMEngine, rows: int = 512, reps: int = 5) -> float:
    """One thread's rate on a large dense product in the model's dtype, at the shape of its
    gate/up projection: what a decode batch's matmuls reach once they are compute-bound. The
    faster of torch's linear and oneDNN's on packed weights: the floor is the best the machine
    does (on an AMD EPYC, Zen 5, MKL's fp32 product ran at 110 GFLOP/s, the packed one at 260)."""
    c, dtype = engine.model_config, engine.model.dtype
    x = torch.randn(rows, c.hidden_size).to(dtype)
    w = torch.randn(2 * c.intermediate_size, c.hidden_size).to(dtype)
    products = [lambda: torch.nn.functional.linear(x, w)]
    if packed_linear.available():
        packed = packed_linear.pack(w)
        products.append(lambda: packed_linear.linear(x, packed, None))
    best = float("inf")
    for product in products:
        product()
        best = min(best, *(_timed(product) for _ in range(reps)))
    return 2 * x.numel() * w.shape[0] / best / 1e9


def flops_per_token(engine: LLMEngine, context: float) -> tuple[float, float]:
    """A decode row's matmul FLOPs (every linear layer, the LM head included) and its
    attention's over `context` cached tokens (q·k and the weighted sum of v, every layer)."""
    c = engine.model_config
    linear = sum(m.in_features * m.out_features for m in engine.model.modules()
                 if isinstance(m, torch.nn.Linear | QuantizedLinear))
    return 2 * linear, 4 * context * c.num_attention_heads * c.head_dim * c.num_hidden_layers


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _counts(weights: PackedWeights | None) -> list[int]:
    """The timed row counts at which the layers multiply by these packed copies."""
    return sorted(weights.counts) if weights is not None else []


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a single stream's decode step reads: every parameter, less the embedding table
    (read by row) unless the LM head is the same tensor; a quantized layer's packed weights."""
    model = engine.model
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total + sum(m.packed_bytes() for m in model.modules()
                       if isinstance(m, QuantizedLinear))


class Parts:
    """Wraps callables in timers that charge each call's own time (its wrapped callees' taken
    out) to a part of the step."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open call: the seconds its wrapped callees took

    def wrap(self, owner: object, attr: str, part: str | Callable[..., str]) -> None:
        """`part` names the part, or tells it from the call's arguments."""
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                name = part(*args, **kwargs) if callable(part) else part
                self.ms[name] += (took - self._inner.pop()) * 1000
                if self._inner:
                    self._inner[-1] += took

        setattr(owner, attr, timed)


def instrument(engine: LLMEngine) -> Parts:
    """Every part of ``engine``'s step wrapped (instance attributes: the engine is this
    script's own)."""
    parts, model = Parts(), engine.model
    parts.wrap(engine, "step", "engine other")
    parts.wrap(engine.scheduler, "schedule", "scheduling")
    parts.wrap(engine.runner, "prepare", "metadata")
    parts.wrap(engine.sampler, "sample", "sampling")
    parts.wrap(model, "forward", "model other")
    parts.wrap(model.attention, "forward", "attention")
    parts.wrap(model.ops, "linear",
               lambda layer, x: "lm_head" if layer is model.lm_head else "matmuls")
    parts.wrap(model.norm, "forward", "norms")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts.wrap(attn, "forward", "attention layer other")
        parts.wrap(mlp, "forward", "mlp activation")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            parts.wrap(norm, "forward", "norms")
    return parts


def profile_step(engine: LLMEngine, parts: Parts) -> dict[str, float]:
    """One engine step, timed by part (ms), with the host overhead summed."""
    parts.ms.clear()
    start = time.perf_counter()
    engine.step()
    out = dict(parts.ms)
    out["step"] = (time.perf_counter() - start) * 1000
    out["host overhead"] = sum(out.get(k, 0.0) for k in HOST)
    out["host share"] = out["host overhead"] / out["step"]
    return out


def decode_steps(engine: LLMEngine, batch: int, prompt: int, steps: int, vocab: int,
                 rng: random.Random) -> tuple[float, float, list[float]]:
    """Prefill ``batch`` prompts, then time ``steps`` decode steps: (prefill s, median decode
    step s, every decode step's s)."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{rng.random()}",
                           [rng.randrange(100, vocab) for _ in range(prompt)], params)
    start = time.perf_counter()
    engine.step()  # the whole batch's prefill (max_num_batched_tokens fits it)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return prefill, statistics.median(times), times


def profiled_steps(engine: LLMEngine, parts: Parts, batch: int, prompt: int, vocab: int,
                   rng: random.Random) -> tuple[dict[str, float], dict[str, float]]:
    """``batch`` prompts prefilled in one step, then one decode step, both timed by part."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profiled-{batch}-{i}",
                           [rng.randrange(100, vocab) for _ in range(prompt)], params)
    prefill = profile_step(engine, parts)
    engine.step()
    decode = profile_step(engine, parts)
    while engine.has_unfinished():
        engine.step()
    return prefill, decode


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="none", choices=("none", "int4", "int8"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--batch", default="1,8,32", help="decode batch sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layer-ops", default="auto", choices=("auto", "torch"),
                   help="torch: the norms, RoPE and activation as torch ops, even where the "
                        "device's fused ones are available")
    p.add_argument("--small-linear-rows", type=int, default=None,
                   help="linear layers at 1 to this many rows through the small-row kernel "
                        "(0: never); default: what this process measured")
    p.add_argument("--prefix-caching", action="store_true",
                   help="finished sequences' blocks stay cached, and later batches evict them "
                        "(tail first), as in a serving engine's pool; without it each batch "
                        "takes blocks in a fresh pool's order")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    tokens = max(batches) * args.prompt
    config = EngineConfig(dtype=args.dtype, quantization=args.quantization,
                          max_num_seqs=max(batches),
                          max_num_batched_tokens=max(tokens, 2048),
                          enable_prefix_caching=args.prefix_caching,
                          num_blocks=max(batches) * (args.prompt + args.decode + 32) // 16 + 64)
    engine = LLMEngine.from_pretrained(resolve_checkpoint(args.model), config)
    if args.layer_ops == "torch":
        engine.model.ops = LayerOps()
    elif args.small_linear_rows is not None and isinstance(engine.model.ops, CPULayerOps):
        engine.model.ops.small_rows = args.small_linear_rows
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    bw = read_bandwidth_gb_s()
    weights = weight_bytes(engine)
    floor_s = weights / (bw * 1e9)
    gflop_s = matmul_gflop_s(engine)
    out: dict = {"cpu": cpu_name(), "threads": args.threads, "dtype": args.dtype,
                 "quantization": args.quantization,
                 "attention": engine.model.attention.name, "layer_ops": engine.model.ops.name,
                 "small_linear_rows": getattr(engine.model.ops, "small_rows", 0),
                 "packed_rows": _counts(getattr(engine.model.ops, "packed", None)),
                 "tile_rows": _counts(getattr(engine.model.ops, "tiles", None)),
                 "read_bandwidth_gb_s": round(bw, 1), "matmul_gflop_s": round(gflop_s, 1),
                 "weight_bytes_per_step": weights,
                 "decode_floor_ms": round(floor_s * 1000, 2), "batches": []}
    print(json.dumps({k: v for k, v in out.items() if k != "batches"}), flush=True)
    decode_steps(engine, 1, 64, 4, vocab, rng)  # warm up
    kv_per_token = kv_bytes_per_token(engine.model_config, engine.dtype)
    for batch in batches:
        prefill, step, _ = decode_steps(engine, batch, args.prompt, args.decode, vocab, rng)
        context = args.prompt + args.decode / 2
        linear_flops, attention_flops = flops_per_token(engine, context)
        weights_s = max(weights / bw, batch * linear_flops / gflop_s) / 1e9
        kv_s = max(batch * context * kv_per_token / bw, batch * attention_flops / gflop_s) / 1e9
        batch_floor_s = weights_s + kv_s
        row = {"batch": batch, "prefill_tok_s": round(batch * args.prompt / prefill, 1),
               "decode_step_ms": round(step * 1000, 2),
               "decode_tok_s": round(batch / step, 1),
               "floor_ms": round(batch_floor_s * 1000, 2),
               "floor_matmuls_ms": round(weights_s * 1000, 2),
               "floor_attention_ms": round(kv_s * 1000, 2),
               "step_over_floor": round(step / batch_floor_s, 2)}
        out["batches"].append(row)
        print(json.dumps(row), flush=True)
    # one timed prefill and decode step of a single stream, and a decode step of the largest
    # batch, by part
    parts = instrument(engine)
    prefill, decode = profiled_steps(engine, parts, 1, args.prompt, vocab, rng)
    profiled = {"decode": decode, "prefill": prefill}
    if max(batches) > 1:
        profiled[f"decode_batch_{max(batches)}"] = profiled_steps(
            engine, parts, max(batches), args.prompt, vocab, rng)[1]
    for name, by_part in profiled.items():
        by_part = {k: round(v, 3) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])}
        out[f"{name}_parts_ms"] = by_part
        print(json.dumps({f"{name}_parts_ms": by_part}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))

if __name__ == "__main__":
    main()
