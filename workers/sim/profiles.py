"""Named cost profiles of the simulated engine: what a model on a device costs per step.

A profile is a linear model of one engine step (one forward pass over every scheduled token)::

    step_s = base
             + prefill_per_token_s * n + prefill_per_token_context_s * n * (c + n / 2)
                                            (per prefill chunk of n tokens after c cached/computed)
             + decode_per_seq_s + decode_per_context_token_s * context
                                            (per decoding sequence)

plus ``loaded bytes / host_load_bytes_per_s`` for the blocks the step loaded from the host KV
tier (its copies run before the forward pass; offloads overlap it and cost nothing here).
``base`` is ``decode_base_s`` for a decode-only step, else the larger of the two bases (a step
reads the weights once, whatever it computes). Prefill cost thus falls with the cached prefix
(only uncached tokens are computed; the attention term still reads the cached context), and a
decode step grows with the batch and with its total context. Select one with
``--model sim:<name>``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from prefixserve.router.registry import Registry
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

# A served sim model has no checkpoint: the ingress tokenizes with the built-in model's tokenizer
# and every token id it may see or emit lies below that tokenizer's vocabulary, so all decode.
TOKENIZER_MODEL = BUILTIN_MODEL_NAME
TOKENIZER_VOCAB_SIZE = 264  # workers.builtin.VOCAB_SIZE (that module imports torch; a test pins it)


@dataclass(frozen=True)
class SimProfile:
    """One model on one device, as the simulated engine sees it."""

    name: str
    vocab_size: int
    max_model_len: int  # the model's context
    kv_bytes_per_token: int  # sizes the default KV pool, as for a real model
    default_kv_cache_bytes: int  # the KV budget when the engine config sets none
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_context_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    max_num_seqs: int = 64  # engine defaults that suit the device (the simulator applies them)
    max_num_batched_tokens: int = 2048
    host_load_bytes_per_s: float = 10e9  # host KV tier -> the pool (a step waits for its loads)

    @property
    def fingerprint(self) -> str:
        """Changes with any parameter: caches of two differently modelled engines never mix."""
        payload = json.dumps(asdict(self), sort_keys=True).encode()
        return "sim-" + hashlib.sha256(payload).hexdigest()[:24]

    @property
    def served_vocab_size(self) -> int:
        """Token ids a served replica accepts and emits: the model's, capped to the tokenizer's."""
        return min(self.vocab_size, TOKENIZER_VOCAB_SIZE)

    def default_num_blocks(self, block_size: int) -> int:
        return max(1, self.default_kv_cache_bytes // (self.kv_bytes_per_token * block_size))

    def step_seconds(
        self, prefills: Iterable[tuple[int, int]], decode_contexts: Iterable[int]
    ) -> float:
        """Modelled time of one step: ``prefills`` as (new tokens, tokens before them), one
        context length per decoding sequence."""
        seconds, any_prefill, any_decode = 0.0, False, False
        for n, before in prefills:
            any_prefill = True
            seconds += n * (self.prefill_per_token_s
                            + self.prefill_per_token_context_s * (before + n / 2))
        for context in decode_contexts:
            any_decode = True
            seconds += self.decode_per_seq_s + self.decode_per_context_token_s * context
        if any_prefill:
            return seconds + max(self.prefill_base_s, self.decode_base_s if any_decode else 0.0)
        return seconds + self.decode_base_s if any_decode else 0.0


# --- cpu-smollm2 -------------------------------------------------------------------------------
# Calibrated on this project's 2-vCPU development VM (shared, torch 1 intra-op thread, float32)
# from the real engine serving smollm2-135m-instruct (SmolLM2-135M-Instruct Q4_1 GGUF, converted
# to fp32), with
#
#     python -m prefixserve.workers.sim.calibrate --model smollm2-135m-instruct --repeats 2
#
# (prefills of 64..2048 tokens, one request, max_tokens=1; decode steps of batch 1..32 at
# contexts 128..1024); the measured medians and the fit follow.
# Vocabulary and context are SmolLM2-135M's (config.json: vocab_size 49152,
# max_position_embeddings 8192); KV per token = 2 (K, V) x 30 layers x 3 KV heads x 64 dims x
# 4 bytes (fp32); the KV budget is the engine's CPU default (256 MiB).
# Measured (medians of 2, one engine step timed with time.perf_counter, 2026-11-30):
#   prefill of   64 /  256 /  512 / 1024 / 2048 tokens: 0.34 / 1.27 / 2.54 / 6.11 / 16.0 s
#   decode step, batch x context  1x128 / 4x128 / 16x128 / 1x1024 / 8x1024 / 32x256:
#                                 0.044 / 0.064 / 0.207  / 0.130  / 0.280  / 1.95 s
# Fit: the coefficients below (decode_base_s came out negative and is clipped to 0). The VM is
# shared with other jobs, so these are slow, noisy figures: recalibrate on the machine you model.
# Host tier: the engine's host-to-pool block copies on this VM, measured with
#     python -m prefixserve.bench.micro.tier_bandwidth
# (SmolLM2-135M fp32 blocks of 16 tokens, 720 KiB each): 8.7 GB/s, 0.78x its memcpy (2026-12-04).

CPU_SMOLLM2 = SimProfile(
    name="cpu-smollm2",
    vocab_size=49152,
    max_model_len=8192,
    kv_bytes_per_token=2 * 30 * 3 * 64 * 4,
    default_kv_cache_bytes=256 * 2**20,
    prefill_base_s=0.0251,
    prefill_per_token_s=4.27e-3,
    prefill_per_token_context_s=2.16e-6,
    decode_base_s=0.0,
    decode_per_seq_s=0.0374,
    decode_per_context_token_s=4.91e-5,
    host_load_bytes_per_s=8.7e9,
)

# --- h100-llama3-8b ----------------------------------------------------------------------------
# Llama-3.1-8B-Instruct (the Llama-3-8B architecture with a 128k context: 32 layers, 32 query /
# 8 KV heads of 128 dims, vocabulary 128,256, 8.03e9 parameters) in bf16 on one H100 SXM 80GB,
# as vLLM V1 serves it. A roofline model with measured efficiencies, cross-checked against a
# published throughput:
#
# * Device: H100 SXM datasheet (NVIDIA, 2023): 3.35 TB/s HBM3, 989 TFLOP/s dense bf16.
# * Decode is memory bound: each step reads the weights (2 x 8.03e9 B) and every sequence's KV
#   (2 x 32 x 8 x 128 x 2 B = 128 KiB per context token) at 77% of peak bandwidth, the fraction
#   vLLM 0.23.0 reached for Llama-3.1-8B single-stream decode on an A100 ("vLLM
#   throughput-latency sweep on NVIDIA A100", John Musgrave, 2025: ~75 tok/s, 77% of the memory
#   roofline) -- assumed to carry over to the H100. Each sequence also adds its matmul FLOPs
#   (2 x 8.03e9 per token) at the prefill rate below.
# * Prefill is compute bound: 2 x 8.03e9 FLOPs per token plus attention, 4 x 32 x 32 x 128 FLOPs
#   per (token, context token), both at an assumed 50% of peak (model FLOPs utilisation).
# * Cross-check: at batch 256 and ~300 tokens of context the model gives ~14k output tok/s, near
#   the ~12.5k tok/s published for Llama 3.1 8B BF16 on 1x H100 with vLLM ("vLLM Benchmarks",
#   morphllm.com, 2026, collecting third-party 2025-26 runs).
# * KV pool: 0.9 x 80 GiB, less 14.96 GiB of weights and ~4 GiB assumed for activations and
#   CUDA graphs, leaves ~53 GiB: ~434k tokens. Batching: vLLM's max_num_seqs default 256, and
#   8192 batched tokens per step (assumed: a typical chunked-prefill budget on an H100).
# * Host KV tier: PCIe 5.0 x16, 64 GB/s per direction (PCI-SIG), at an assumed 80% for copies
#   from pinned memory in blocks of 16 tokens (2 MiB each here).
_H100_BW = 3.35e12 * 0.77  # bytes/s achieved
_H100_FLOPS = 989e12 * 0.5  # FLOP/s achieved
_LLAMA3_8B_PARAMS = 8.03e9
_LLAMA3_8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2

H100_LLAMA3_8B = SimProfile(
    name="h100-llama3-8b",
    vocab_size=128256,
    max_model_len=131072,
    kv_bytes_per_token=_LLAMA3_8B_KV_PER_TOKEN,
    default_kv_cache_bytes=53 * 2**30,
    prefill_base_s=2 * _LLAMA3_8B_PARAMS / _H100_BW,
    prefill_per_token_s=2 * _LLAMA3_8B_PARAMS / _H100_FLOPS,
    prefill_per_token_context_s=4 * 32 * 32 * 128 / _H100_FLOPS,
    decode_base_s=2 * _LLAMA3_8B_PARAMS / _H100_BW,
    decode_per_seq_s=2 * _LLAMA3_8B_PARAMS / _H100_FLOPS,
    decode_per_context_token_s=_LLAMA3_8B_KV_PER_TOKEN / _H100_BW,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    host_load_bytes_per_s=64e9 * 0.8,
)

SIM_PREFIX = "sim:"
PROFILES: Registry[SimProfile] = Registry(
    "simulation profile", {p.name: p for p in (CPU_SMOLLM2, H100_LLAMA3_8B)},
    unknown=lambda name, known: ValueError(
        f"no simulation profile {name!r} (known: {', '.join(SIM_PREFIX + n for n in known)})"))


def is_sim_model(model: str) -> bool:
    """Whether a ``--model`` value names a simulated model (``sim:<profile>``)."""
    return model.startswith(SIM_PREFIX)


def profile_for(model: str) -> SimProfile:
    """The profile ``sim:<name>`` (or a bare ``<name>``) names; ValueError lists the known."""
    return PROFILES.lookup(model.removeprefix(SIM_PREFIX))


def served_name(model: str) -> str:
    """The name clients send for ``sim:<profile>`` by default: ``sim-<profile>``."""
    return "sim-" + profile_for(model).name
