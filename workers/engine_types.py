"""What goes into the engine (`EngineConfig`) and what comes out of it, per step and per
`generate` call. Plain data with no torch, so Serve-side code can import it cheaply."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixserve.router.adapters import CONFIG_FILE, WEIGHTS_FILE
from prefixserve.router.blocks import DEFAULT_BLOCK_SIZE
from prefixserve.router.events import WorkerLoad
from prefixserve.router.request import TokenLogprob
from prefixserve.workers.cpu_dtype import cpu_auto_dtype
from prefixserve.workers.kv_tiers.base import TierCounters

INTERNAL = {"internal": True}  # a config field set by the system, not offered as a CLI flag
RATE_SMOOTHING = 0.2  # weight of the newest step in the engines' exponentially smoothed rates
# The time constant of an engine's busy share: long, since a conversation keeps its worker
# busy for many minutes (on the Mooncake traces, 2 and 10 minutes balanced the workers less).
BUSY_WINDOW_S = 1800.0


class EngineConfig(BaseModel):
    """The engine section of the cluster config: one worker's engine, its KV pool and batching.

    Fields marked ``internal`` are set by the replica, not by users (no CLI flag).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(
        DEFAULT_BLOCK_SIZE, ge=1, le=1024, description="Tokens per KV block (and per hash)")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks per worker (exact); else from kv_cache_memory_bytes")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV budget per worker; default 256 MiB on CPU, on a GPU what the "
        "weights leave of gpu_memory_utilization")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of the GPU's memory a worker may use "
        "(weights + KV pool), as vLLM's --gpu-memory-utilization; sets the default KV budget")
    max_num_seqs: int = Field(64, ge=1, description="Sequences batched per engine step")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Tokens per engine step (long prefills are chunked)")
    max_model_len: int | None = Field(
        None, ge=2, description="Context length (prompt + output), at most the KV cache's; "
        "default: the model's, capped to the KV cache")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV cache dtype; auto: bfloat16 on GPU and on CPUs with "
        "AMX or AVX512-BF16, float32 on other CPUs")
    quantization: Literal["none", "int4", "int8"] = Field(
        "none", description="Weight-only quantization of the linear layers, CPU only (vLLM's "
        "--quantization): int4 in groups of 32 with a scale and offset each (GGUF Q4_1's "
        "shape), int8 with a scale per output row; decode batches up to a size measured at "
        "start run a packed kernel (for int4, prefixserve's or torch's, whichever measured "
        "faster), larger ones a dense copy of the same weights")
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of prefixes")
    enforce_eager: bool = Field(
        False, description="Run every step op by op (vLLM's --enforce-eager); otherwise on a "
        "GPU a decode step of up to max_num_seqs sequences and 8,192 tokens of context replays "
        "a CUDA graph captured for its batch and context size")
    kv_offloading_size: float = Field(
        0.0, ge=0.0, description="GiB of host memory per worker for KV blocks evicted from "
        "the pool, least recently used dropped (vLLM's --kv-offloading-size); 0: none")
    kv_offloading_backend: Literal["native"] = Field(
        "native", description="What keeps offloaded KV blocks (vLLM's "
        "--kv-offloading-backend): native, this engine's host and disk tiers")
    kv_disk_dir: str | None = Field(
        None, description="Folder for a disk KV tier below the host tier: every computed block "
        "is written there (capped by kv_disk_size), and a worker restarted on it finds its "
        "model's blocks again; none by default")
    kv_disk_size: float = Field(
        16.0, gt=0.0, description="GiB the disk KV tier may use per worker")
    max_lora_rank: int = Field(16, ge=1, description="Largest rank of a LoRA adapter the "
                               "engine takes (vLLM's --max-lora-rank)")
    max_loras: int = Field(4, ge=1, description="LoRA adapters one step mixes, held in its "
                           "slots, least recently used evicted (vLLM's --max-loras)")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept in host memory beyond those queued "
        "requests use, least recently used dropped (vLLM's --max-cpu-loras); default max_loras")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters every worker loads at start, served "
        "under their names as models (vLLM's --lora-modules): `name=path` pairs separated by "
        "spaces or commas, or a JSON object; each path a folder in PEFT's layout")
    device: str = Field(
        "auto", description="auto | cpu | cuda | cuda:N; auto: the GPU Ray assigned, else CPU",
        json_schema_extra=INTERNAL)
    model_fingerprint: str | None = Field(
        None, description="Default: derived from the checkpoint files", json_schema_extra=INTERNAL)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        """vLLM's `name=path name2=path2` (commas too), or JSON text; each path a folder with
        PEFT's two files, made absolute here (a worker may start elsewhere)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                value = json.loads(text)
            else:
                pairs = [p.split("=", 1) for p in text.replace(",", " ").split()]
                if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
                    raise ValueError("give adapters as name=path pairs")
                value = dict(pairs)
        if isinstance(value, dict):
            for name, path in value.items():
                folder = Path(str(path)).expanduser()
                missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
                if missing:
                    raise ValueError(f"adapter {name!r}: {folder} has no {', '.join(missing)}")
                value[name] = str(folder.resolve())
        return value

    @model_validator(mode="after")
    def _lora_bounds(self) -> EngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        return self

    @model_validator(mode="after")
    def _one_pool_size(self) -> EngineConfig:
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("set num_blocks or kv_cache_memory_bytes, not both")
        if self.num_blocks is not None and self.max_model_len is not None:
            needed = -(-self.max_model_len // self.block_size)
            if needed > self.num_blocks:  # the engine would refuse it at start-up, later
                raise ValueError(
                    f"max_model_len {self.max_model_len} needs {needed} KV blocks of "
                    f"{self.block_size} tokens, but num_blocks is {self.num_blocks}")
        return self

    def dtype_for(self, device_type: str) -> str:
        """The concrete dtype on a device: auto is bfloat16 on GPU, and on a CPU what
        :func:`workers.cpu_dtype.cpu_auto_dtype` finds it runs fast."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device_type == "cuda" else cpu_auto_dtype()[0]


@dataclass
class RequestOutput:
    """New tokens of one sample of a request in one step."""

    request_id: str
    index: int  # which of the n samples (0..n-1)
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class LoRAStats:
    """Where a worker's LoRA adapters are (workers/lora_store.py)."""

    registered: int = 0  # adapters served by name
    max_loras: int = 0  # batch slots
    resident: tuple[str, ...] = ()  # identities in slots, least recently used first
    loads: int = 0  # into a slot, cumulative
    reads: int = 0  # from their files, cumulative
    evictions: int = 0  # from a slot, cumulative
    load_s: float = 0.0  # smoothed seconds a slot load took


@dataclass
class EngineStats:
    prompt_tokens_queried: int  # cumulative, in tokens (vLLM style)
    prompt_tokens_hit: int
    kv_usage: float  # 0..1 of blocks in use
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens not yet prefilled
    prefill_tokens_per_s: float  # measured, smoothed
    decode_tokens_per_s: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int = 0
    num_empty_blocks: int = 0  # free blocks holding no cached prefix (room that evicts nothing)
    busy_share: float = 0.0  # of recent time spent in steps (BusyShare)
    lora: LoRAStats = field(default_factory=LoRAStats)
    running_loras: tuple[str, ...] = ()  # adapters of running sequences, sorted
    waiting_loras: tuple[str, ...] = ()  # adapters of waiting ones
    external_tokens_queried: int = 0  # cumulative: prompt tokens looked up below the pool
    external_tokens_hit: int = 0  # and loaded from there
    tiers: TierCounters | None = None  # the KV tiers' byte, time and failure counts
    host_load_tokens_per_s: float = 0.0  # measured loads from the host tier (0: none yet)
    disk_load_tokens_per_s: float = 0.0

    def load(self, timestamp: float) -> WorkerLoad:
        """The load report routers read; ``timestamp`` is when these stats were taken (routers
        count what they sent after it as not yet in it)."""
        return WorkerLoad(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            queued_prefill_tokens=self.queued_prefill_tokens,
            kv_usage=self.kv_usage,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            kv_empty_blocks=self.num_empty_blocks,
            kv_total_blocks=self.num_total_blocks,
            busy_share=self.busy_share,
            host_load_tokens_per_s=self.host_load_tokens_per_s,
            disk_load_tokens_per_s=self.disk_load_tokens_per_s,
            timestamp=timestamp,
        )


@dataclass
class BusyShare:
    """The share of recent time an engine spent in steps, exponentially averaged over
    ``window_s``. Routers give ties between equally cheap workers to the least busy, so new
    prefixes spread by the work each worker has done lately, not only by the instant's queues
    (which are empty at low load, when every idle worker ties)."""

    window_s: float = BUSY_WINDOW_S
    value: float = 0.0
    at: float | None = None  # when ``value`` was last brought up to date

    def add(self, seconds: float, now: float) -> None:
        """A step of ``seconds`` ended at ``now``."""
        self.value = self.read(now) + seconds / self.window_s
        self.at = now

    def read(self, now: float) -> float:
        if self.at is None:
            return 0.0
        return min(1.0, self.value * math.exp(-max(0.0, now - self.at) / self.window_s))


@dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None


@dataclass
class GenerateOutput:
    """One prompt's result from :meth:`LLMEngine.generate`: its ``n`` samples in index order."""

    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    samples: list[SampleOutput]
