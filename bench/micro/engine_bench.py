"""Engine throughput and TTFT against transformers' own continuous batching, same weights.

    python -m prefixserve.bench.micro.engine_bench            # the default real model, full size
    python -m prefixserve.bench.micro.engine_bench --quick    # scaled down
    python -m prefixserve.bench.micro.engine_bench --device cuda --quick   # on a GPU (bf16)
    python -m prefixserve.bench.micro.engine_bench --device cuda --quick --enforce-eager  # eager

The model is any `--model` value (default: SmolLM2-135M-Instruct, dequantized from its GGUF);
transformers loads the same dequantized weights from the converted checkpoint directory.

Workloads: (a) 64 requests, prompts 64-512 tokens, outputs 32-256 tokens; (b) 32 requests that
share a 1,024-token prefix, each with a 64-token unique suffix. Both engines decode greedily with
EOS ignored, so they produce the same number of tokens; agreement of the token streams is
reported too. Then the TTFT of a cold 2,048-token prompt vs a warm one with 1,984 tokens cached,
and the share of the machine's GEMM FLOP/s (torch.mm, or on a CPU oneDNN's packed product where
faster) our engine achieves on (a). Last, how long
loading takes from the GGUF itself and from the converted directory a worker starts from.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import DEFAULT_MODEL, is_gguf, locate, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.models import packed_linear
from prefixserve.workers.models.base import to_dtype
from prefixserve.workers.models.config import ModelConfig, load_model_config


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random ordinary token ids (the first ids of real vocabularies are special tokens)."""
    return [rng.randrange(100, vocab) for _ in range(n)]


def workload_a(n: int, scale: float, rng: random.Random, vocab: int) -> list[Req]:
    lo_p, hi_p, lo_o, hi_o = (int(x * scale) for x in (64, 512, 32, 256))
    return [Req(tokens(rng, rng.randint(lo_p, hi_p), vocab), rng.randint(lo_o, hi_o))
            for _ in range(n)]


def workload_b(n: int, prefix_len: int, suffix_len: int, out: int, rng: random.Random,
               vocab: int) -> list[Req]:
    prefix = tokens(rng, prefix_len, vocab)
    return [Req(prefix + tokens(rng, suffix_len, vocab), out) for _ in range(n)]


def run_ours(engine: LLMEngine, reqs: list[Req]) -> tuple[float, list[list[int]], int]:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    before = engine.stats().prompt_tokens_hit
    start = time.perf_counter()
    results = engine.generate([r.prompt for r in reqs], params)
    seconds = time.perf_counter() - start
    return (
        seconds,
        [r.samples[0].token_ids for r in results],
        (engine.stats().prompt_tokens_hit - before),
    )


def run_hf(model, reqs: list[Req], max_batch_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in reqs),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )
    cb = ContinuousBatchingConfig(
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=64,
        num_blocks=max(64, sum(len(r.prompt) + r.max_tokens for r in reqs) // 256 + len(reqs)),
    )
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(
                r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1
            )
            for i, r in enumerate(reqs)
        ]
        done: dict[str, list[int]] = {}
        while len(done) < len(reqs):
            result = manager.get_result(timeout=1)  # only finished requests are delivered
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching thread died")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers failed: {result.error}")
                done[result.request_id] = list(result.generated_tokens)
        seconds = time.perf_counter() - start
    return seconds, [done[i] for i in ids]


def note(msg: str) -> None:
    """Progress on stderr, so a long run that dies midway still shows what it measured."""
    print(msg, file=sys.stderr, flush=True)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy token streams are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of a square product in the engine's dtype, the machine's practical ceiling: torch.mm,
    or on a CPU the faster of it and oneDNN's product over a packed weight, which the engine's
    linear layers use where faster (an AMD EPYC's MKL ran fp32 at 110 GFLOP/s, the packed
    product at 260)."""
    if device.type == "cuda":
        n, reps = 8192, 50
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    products = [lambda: torch.mm(a, b)]
    if device.type == "cpu" and packed_linear.available():
        packed = packed_linear.pack(b.t().contiguous())
        products.append(lambda: packed_linear.linear(a, packed, None))
    best = 0.0
    for product in products:
        product()
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            product()
        sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def matmul_params(c: ModelConfig) -> int:
    """Weights every token multiplies through (attention projections, MLP, LM head)."""
    h, d, heads, kvh = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    per_layer = h * (heads + 2 * kvh) * d + heads * d * h + 3 * h * c.intermediate_size
    return c.num_hidden_layers * per_layer + h * c.vocab_size


def load_times(model: str, config: EngineConfig) -> tuple[float | None, float]:
    """Seconds to an engine from the GGUF itself (None if the model is no GGUF) and from the
    converted directory a worker starts from."""
    path = resolve_checkpoint(model)
    source = locate(model)
    direct = None
    if is_gguf(source):
        start = time.perf_counter()
        LLMEngine.from_pretrained(source, config)
        direct = time.perf_counter() - start
    start = time.perf_counter()
    LLMEngine.from_pretrained(path, config)
    return direct, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a known model name, checkpoint directory or .gguf file")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--quick", action="store_true", help="scaled-down sizes (a few minutes)")
    ap.add_argument("--skip-hf", action="store_true", help="only our engine")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no decode graphs on a GPU (the engine's enforce_eager)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for BOTH engines on CPU (default 1: on a shared, "
        "oversubscribed 2-core VM, OpenMP GEMMs with 2 threads spin at barriers and run 5-10x "
        "slower)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # HF's generation thread inherits it
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.quick:
        na, scale_a, nb, prefix, suffix, out_b, ttft_len = 16, 0.5, 16, 512, 64, 32, 1024
    else:
        na, scale_a, nb, prefix, suffix, out_b, ttft_len = 64, 1.0, 32, 1024, 64, 64, 2048
    cached_len = ttft_len - 64
    path = resolve_checkpoint(args.model)
    mc = load_model_config(path)
    vocab = mc.vocab_size
    rng = random.Random(0)
    reqs_a = workload_a(na, scale_a, rng, vocab)
    reqs_b = workload_b(nb, prefix, suffix, out_b, rng, vocab)
    config = EngineConfig(
        device=args.device,
        dtype=dtype,
        kv_cache_memory_bytes=(8 * 2**30 if device.type == "cuda" else 768 * 2**20),
        max_num_seqs=64,
        max_num_batched_tokens=args.max_batched_tokens,
        enforce_eager=args.enforce_eager,
    )
    direct_load, cached_load = load_times(args.model, config)
    note(f"load: GGUF {direct_load} s, converted directory {cached_load:.1f} s")
    engine = LLMEngine.from_pretrained(path, config)
    ttft_engine = LLMEngine.from_pretrained(path, config)
    engine.generate([reqs_a[0].prompt[:32]], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    rows = []
    out_a = sum(r.max_tokens for r in reqs_a)
    out_b_total = sum(r.max_tokens for r in reqs_b)
    t_a, toks_a, _ = run_ours(engine, reqs_a)
    note(f"ours (a): {out_a / t_a:.1f} tok/s in {t_a:.1f} s")
    engine.reset_prefix_cache()
    t_b, toks_b, hit_b = run_ours(engine, reqs_b)
    note(f"ours (b): {out_b_total / t_b:.1f} tok/s in {t_b:.1f} s")
    hf = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=to_dtype(dtype)).eval()
        model = model.to(device)
        run_hf(model, [Req(reqs_a[0].prompt[:32], 2)], args.max_batched_tokens)  # warm-up
        for name, reqs, n_out in (("a", reqs_a, out_a), ("b", reqs_b, out_b_total)):
            hf[name] = run_hf(model, reqs, args.max_batched_tokens)
            note(f"HF ({name}): {n_out / hf[name][0]:.1f} tok/s in {hf[name][0]:.1f} s")
    for name, t, toks, n_out, reqs in (
        ("a", t_a, toks_a, out_a, reqs_a),
        ("b", t_b, toks_b, out_b_total, reqs_b),
    ):
        ours = n_out / t
        if name in hf:
            t_hf, toks_hf = hf[name]
            theirs = n_out / t_hf
            rows.append((name, len(reqs), ours, theirs, ours / theirs, agreement(toks, toks_hf)))
        else:
            rows.append((name, len(reqs), ours, float("nan"), float("nan"), float("nan")))

    base = tokens(rng, ttft_len, vocab)
    cold = ttft(ttft_engine, base)
    ttft_engine.generate([base[:cached_len] + [105] * 8], SamplingParams(max_tokens=1))  # prime
    warm_prompt = base[:cached_len] + tokens(rng, 64, vocab)
    warm = ttft(ttft_engine, warm_prompt)
    note(f"TTFT cold {cold:.2f} s, warm {warm:.2f} s")

    peak = gemm_peak(device, to_dtype(dtype))
    prompt_a = sum(len(r.prompt) for r in reqs_a)
    weights = matmul_params(mc)
    achieved = 2 * weights * (prompt_a + out_a) / t_a

    print()
    print(
        f"model: {args.model} ({mc.architecture}, {mc.num_hidden_layers} layers, hidden "
        f"{mc.hidden_size}, {mc.num_attention_heads} query / {mc.num_key_value_heads} KV heads, "
        f"head_dim {mc.head_dim}, FFN {mc.intermediate_size}, vocab {vocab}), {dtype} on "
        f"{device} ({path})"
    )
    threads = f"{torch.get_num_threads()} thread(s) for both engines; " if device.type == "cpu" \
        else f"{torch.cuda.get_device_name(device)}; "
    print(
        f"machine: {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch "
        f"{torch.__version__}, {threads}"
        f"max_num_batched_tokens={args.max_batched_tokens}{' (--quick)' if args.quick else ''}"
    )
    print()
    print(
        f"{'workload':<50} {'reqs':>5} {'ours tok/s':>11} {'HF CB tok/s':>12} "
        f"{'ratio':>6} {'same tokens':>12}"
    )
    labels = {
        "a": f"(a) prompts {int(64 * scale_a)}-{int(512 * scale_a)}, "
        f"outputs {int(32 * scale_a)}-{int(256 * scale_a)}",
        "b": f"(b) shared {prefix}-token prefix + {suffix} unique, out {out_b}",
    }
    for name, n, ours, theirs, ratio, same in rows:
        print(
            f"{labels[name]:<50} {n:>5} {ours:>11.1f} {theirs:>12.1f} {ratio:>5.2f}x {same:>11.0%}"
        )
    print(f"(b) prefix-cache hit: {hit_b} of {sum(len(r.prompt) for r in reqs_b)} prompt tokens")
    print()
    print(
        f"TTFT {ttft_len}-token prompt: cold {cold * 1e3:.0f} ms, warm ({cached_len} cached) "
        f"{warm * 1e3:.0f} ms = {warm / cold:.1%} of cold"
    )
    print(
        f"GEMM: peak {peak / 1e9:.1f} GFLOP/s; engine on (a) achieves "
        f"{achieved / 1e9:.1f} GFLOP/s (2 x {weights / 1e6:.1f}M matmul weights x "
        f"{prompt_a + out_a} tokens / {t_a:.1f} s) = {achieved / peak:.0%} of peak"
    )
    shown = "n/a (not a GGUF)" if direct_load is None else f"{direct_load:.1f} s"
    print(f"engine load: from the GGUF {shown}; from the converted directory {cached_load:.1f} s")


if __name__ == "__main__":
    main()
