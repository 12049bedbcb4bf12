"""LLMEngine: token-in / token-out generation with continuous batching and prefix caching.

One step = schedule (scheduler.py) → copy-on-write copies → one forward pass over every
scheduled token (model_runner.py) → sample → append, stop checks, fork ``n > 1`` samples →
deliver the step's KV events to ``on_kv_events``. Single-threaded: the replica drives it from
one loop thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixserve.router.adapters import adapter_name
from prefixserve.router.events import KVEvent
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.checkpoints import checkpoint_fingerprint
from prefixserve.workers.cpu_dtype import cpu_auto_dtype
from prefixserve.workers.decode_graphs import DecodeGraphs, graphs_by_default
from prefixserve.workers.engine_core import EngineCore, EngineRequest, check_max_model_len
from prefixserve.workers.engine_types import (
    EngineConfig,
    GenerateOutput,
    LoRAStats,
    RequestOutput,
    SampleOutput,
)
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.kv_tensor import (
    allocate_kv_cache,
    blocks_for_budget,
    copy_blocks,
    kv_bytes_per_token,
    log_kv_budget,
)
from prefixserve.workers.kv_tiers.build import build_tiers
from prefixserve.workers.logits_processors import TokenHistory, needs_history
from prefixserve.workers.lora import AdapterError, LoRAAdapter, load_adapter
from prefixserve.workers.lora_store import AdapterRef, LoRAStore
from prefixserve.workers.model_runner import ModelRunner, keep_cpu_heap
from prefixserve.workers.models.base import CausalLM
from prefixserve.workers.models.loader import load_model, resolve_device
from prefixserve.workers.sampling import Sampler, make_generator
from prefixserve.workers.scheduler import SchedulerOutput, Sequence
from prefixserve.workers.structured import GrammarCompiler, accept, mask_logits, new_matcher

log = logging.getLogger(__name__)


class LLMEngine(EngineCore):
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        model_fingerprint: str,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
        tokenizer_path: Path | None = None,
        decode_graphs: bool | None = None,
    ) -> None:
        """`decode_graphs`: pad decode steps to captured buckets (`workers.decode_graphs`);
        None: on a GPU unless `config.enforce_eager`. Off a GPU the buckets run eagerly."""
        mc = model.config
        check_max_model_len(config.max_model_len, mc.max_model_len)
        weight = next(model.parameters())
        device = weight.device
        # the KV cache in the weights' dtype, whatever built them (from_pretrained: the config's)
        self.dtype = str(weight.dtype).removeprefix("torch.")
        per_token = kv_bytes_per_token(mc, self.dtype)
        num_blocks = config.num_blocks or blocks_for_budget(
            config.kv_cache_memory_bytes, per_token, config.block_size, device,
            config.gpu_memory_utilization,
        )
        super().__init__(config, model_fingerprint, mc.vocab_size, tuple(mc.eos_token_ids),
                         mc.max_model_len, num_blocks, on_kv_events)
        self.model = model
        self.model_config = mc
        if decode_graphs is None:
            decode_graphs = graphs_by_default(model, device, config.enforce_eager)
        # decode graphs pad with a block of their own: one past those the pool hands out
        scratch = 1 if decode_graphs else 0
        self.kv_cache = allocate_kv_cache(mc, num_blocks + scratch, config.block_size,
                                          self.dtype, device)
        graphs = DecodeGraphs(model, self.kv_cache, self.block_size, config.max_num_seqs,
                              self.max_model_len, num_blocks) if decode_graphs else None
        self.runner = ModelRunner(model, self.kv_cache, self.block_size, graphs)
        order = model.attention.kv_layout(weight.dtype, config.block_size, mc.head_dim,
                                          mc.num_attention_heads, mc.num_key_value_heads)
        tiers = build_tiers(config, self.kv, self.kv_cache, model_fingerprint, order)
        if tiers is not None:
            self.attach_tiers(tiers)
        self.lora_store = LoRAStore(self._read_lora, self._adapters_in_use, device,
                                    config.max_loras, config.max_cpu_loras or config.max_loras)
        self.sampler = Sampler()
        # structured outputs need the vocabulary's text: the checkpoint's tokenizer
        self.grammars = None if tokenizer_path is None else GrammarCompiler(
            tokenizer_path, mc.vocab_size, mc.eos_token_ids)
        log_kv_budget(mc, self.dtype, per_token, num_blocks, config.block_size)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> LLMEngine:
        config = config or EngineConfig()
        device = resolve_device(config.device)
        if device.type == "cpu":
            keep_cpu_heap()
        dtype = config.dtype_for(device.type)
        if config.dtype == "auto" and device.type == "cpu":
            log.info("dtype auto: %s, as %s", dtype, cpu_auto_dtype()[1])
        model = load_model(path, dtype, device, config.quantization)
        fingerprint = config.model_fingerprint or checkpoint_fingerprint(path)
        tokenizer = Path(path) if (Path(path) / "tokenizer.json").is_file() else None
        engine = cls(model, config, fingerprint, on_kv_events, tokenizer)
        for name, folder in config.lora_modules.items():
            engine.add_lora(name, folder)
        return engine

    def describe_compute(self) -> str:
        """The dtype, attention backend and layer ops the model runs, and whether decode steps
        replay graphs, for the worker's start-up log."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        graphs = "" if self.runner.graphs is None else ", decode graphs"
        return (f"{dtype}, attention {self.model.attention.name}, layer ops "
                f"{self.model.ops.name}{graphs}")

    def _init_seq(self, seq: Sequence, req: EngineRequest) -> None:
        """Each sample draws from its own generator (seeded per sample index), follows its
        own grammar matcher when constrained, and runs under its request's LoRA adapter."""
        seq.extra["gen"] = make_generator(seq.params, seq.index, self.kv_cache.device)
        if req.grammar is not None:
            seq.extra["matcher"] = new_matcher(req.grammar)
        if req.lora is not None:
            self.lora_store.hold(req.lora)

    # ----------------------------------------------------------------- LoRA adapters

    def _read_lora(self, name: str, path: str) -> LoRAAdapter:
        return load_adapter(name, path, self.model_config, self.model.dtype,
                            torch.device("cpu"), self.config.max_lora_rank)

    def add_lora(self, name: str, path: str | Path) -> AdapterRef:
        """Serve the adapter at `path` as `name`; AdapterError (nothing loaded) when it does
        not fit this model. A name already taken is replaced for later requests."""
        return self.lora_store.register(name, str(path))

    def remove_lora(self, name: str) -> None:
        """Admit no more requests under `name`; the queued and running ones finish under it."""
        self.lora_store.remove(name)

    def load_lora(self, name: str, path: str) -> str:
        """`add_lora` for a request of the API: the adapter's identity, or its AdapterError
        as an InvalidRequestError (a 400 naming the reason)."""
        try:
            return self.add_lora(name, path).identity
        except AdapterError as exc:
            raise _refused(name, exc, "lora_path") from None

    def lora_for(self, identity: str, path: str | None = None) -> AdapterRef:
        """The adapter a request names by identity (`name@digest`, as the ingress computed it
        from the same files), registered from `path` first if this engine lacks it (an adapter
        loaded at run time reaches each worker with its first request there; the worker reads
        it before it queues: `LoRAStore.prefetch`); InvalidRequestError if unknown or if its
        weights differ here."""
        name = adapter_name(identity)
        known = self.lora_store.known.get(name)
        if (known is None or known.identity != identity) and path is not None:
            try:
                return self.lora_store.register(name, path, identity)
            except AdapterError as exc:
                raise _refused(name, exc, "model") from None
        ref = self.lora(name)
        assert ref is not None
        if ref.identity != identity:
            raise InvalidRequestError(f"LoRA adapter {name!r} has other weights on this "
                                      f"worker ({ref.identity}) than asked ({identity})",
                                      "model")
        return ref

    def prefetch_lora(self, identity: str, path: str | None) -> None:
        """Read the adapter a request names into host memory unless held, so that `lora_for`
        on the engine loop finds it there. Safe on any thread (the store's host copies are
        locked); an adapter this engine cannot find is left to `lora_for` to refuse."""
        name = adapter_name(identity)
        known = self.lora_store.known.get(name)
        path = path or (known.path if known is not None else None)
        if path is None:
            return
        try:
            self.lora_store.prefetch(name, path, identity)
        except AdapterError as exc:
            raise _refused(name, exc, "model") from None

    def lora(self, name: str | None) -> AdapterRef | None:
        """The adapter called `name` (None: the base model); InvalidRequestError if unknown."""
        if name is None:
            return None
        ref = self.lora_store.known.get(name)
        if ref is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "model")
        return ref

    def lora_stats(self) -> LoRAStats:
        return self.lora_store.stats()

    def _adapters_in_use(self) -> set[str]:
        s = self.scheduler
        return {q.adapter for q in (*s.running, *s.waiting) if q.adapter is not None}

    def _step_adapters(self, sched: SchedulerOutput) -> list[LoRAAdapter | None] | None:
        """Each scheduled sequence's adapter, in a batch slot; None when none has one."""
        needed = {seq.adapter for seq in sched.seqs if seq.adapter is not None}
        if not needed:
            return None
        slots = self.lora_store.activate(needed, self.scheduler.running_adapters())
        return [None if seq.adapter is None else slots[seq.adapter] for seq in sched.seqs]

    # ----------------------------------------------------------------- the step

    def _execute(self, sched: SchedulerOutput, copies: list[tuple[int, int]],
                 outputs: list[RequestOutput]) -> float:
        """Copy-on-write copies, one forward pass over the scheduled tokens, then sample and
        append; returns the seconds it took."""
        if copies:
            copy_blocks(self.kv_cache, copies)
        start = time.perf_counter()
        logits, sampled = self.runner.execute(sched, self._step_adapters(sched))
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        if logits is not None:
            self._sample_and_append(logits, sampled, outputs)
        return time.perf_counter() - start

    def _sample_and_append(
        self, logits: torch.Tensor, sampled: list[Sequence], outputs: list[RequestOutput]
    ) -> None:
        targets, rows = self._fork_sampled(sampled)
        if len(rows) != len(sampled):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        params = [s.params for s in targets]
        gens = [s.extra["gen"] for s in targets]
        histories = None
        if any(needs_history(p) for p in params):
            histories = [self._history(s) if needs_history(s.params) else None for s in targets]
        matchers = [s.extra.get("matcher") for s in targets]
        constrained = any(m is not None for m in matchers)
        if constrained:  # on the raw logits, before any processor (vLLM's order)
            mask_logits(logits, matchers)
        token_ids, logprobs = self.sampler.sample(logits, params, gens, histories)
        if constrained:
            accept(matchers, token_ids)
        self._append_tokens(zip(targets, token_ids, logprobs, strict=True), outputs)

    def _history(self, seq: Sequence) -> TokenHistory:
        """The sequence's TokenHistory, made at its first penalized step and kept (it caches the
        prompt's ids on the device)."""
        history = seq.extra.get("history")
        if history is None:
            stop_ids = self._requests[seq.request_id].stop_ids
            history = TokenHistory(seq.token_ids, seq.num_prompt_tokens, stop_ids)
            seq.extra["history"] = history
        return history

    def compile(self, params: SamplingParams) -> Any:
        """The request's compiled constraint (None without one); InvalidRequestError when it
        does not compile, or when this engine has no tokenizer to compile against."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError(f"{params.structured.field}: structured outputs need the "
                                      "checkpoint's tokenizer.json, which this model lacks",
                                      params.structured.field)
        return self.grammars.compile(params.structured)

    # ----------------------------------------------------------------- offline & introspection

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        cache_salt: str | None = None,
        lora: str | list[str | None] | None = None,
    ) -> list[GenerateOutput]:
        """Run a batch to completion, each prompt under its LoRA adapter (a name, or one per
        prompt; None: the base model); results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        names = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(plist) != len(prompts) or len(names) != len(prompts):
            raise InvalidRequestError("need one SamplingParams and adapter per prompt")
        results: dict[str, GenerateOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
                rid = f"generate-{id(results)}-{i}"
                self.add_request(rid, prompt, p, cache_salt, grammar=self.compile(p),
                                 lora=self.lora(names[i]))
                results[rid] = GenerateOutput(
                    rid,
                    list(prompt),
                    0,
                    [
                        SampleOutput(j, [], None, [] if p.logprobs is not None else None)
                        for j in range(p.n)
                    ],
                )
            while any(rid in self._requests for rid in results):
                for out in self.step():
                    res = results.get(out.request_id)
                    if res is None:
                        continue
                    sample = res.samples[out.index]
                    sample.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs and sample.logprobs is not None:
                        sample.logprobs.extend(out.new_logprobs)
                    res.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        sample.finish_reason = out.finish_reason
        except BaseException:
            # all or nothing: withdraw this call's requests so the engine is reusable
            for rid in results:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in results]
            raise
        return list(results.values())


def _refused(name: str, exc: AdapterError, param: str) -> InvalidRequestError:
    """An adapter that does not fit, as a 400 naming the reason and the field."""
    return InvalidRequestError(f"LoRA adapter {name!r}: {exc}", param)
