"""A simulated engine: the real scheduler and KV bookkeeping, modelled time instead of a model.

:class:`SimEngine` shares :class:`workers.engine_core.EngineCore` (scheduler, KV manager,
requests, forking, stop checks, outputs, stats) with :class:`workers.engine.LLMEngine`, so its
prefix hits, KV events, preemptions and load are the real engine's for the same token streams;
only the forward pass is replaced by a cost model (:mod:`workers.sim.profiles`) and the sampler
by a token source. ``kv_offloading_size`` gives it the real engine's host tier (the same
``workers.kv_tiers`` code, keeping which blocks are where but no contents), whose loads add the
profile's copy time to the step. No tensors: a thousand of them fit in one process
(``bench.sim.simulate``).

Time: each step's modelled duration is ``last_step_s``. With ``sleep=True`` (a Serve replica)
``step`` sleeps it, so streams take modelled time; otherwise the caller owns the clock (the
tier-2 simulator advances a virtual one) and ``clock_s`` sums the steps.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

from prefixserve.router.events import HOST, KVEvent
from prefixserve.workers.engine_core import EngineCore, EngineRequest, check_max_model_len
from prefixserve.workers.engine_types import EngineConfig, RequestOutput
from prefixserve.workers.kv_tiers.host import HostTier
from prefixserve.workers.kv_tiers.offload import TieredKV
from prefixserve.workers.scheduler import SchedulerOutput, Sequence
from prefixserve.workers.sim.profiles import SimProfile

TokenSource = Callable[[Sequence], int]


def hashed_token(vocab_size: int, request_id: str, index: int, position: int) -> int:
    """The stand-in token of one (request, sample, position): reproducible across processes
    (unlike ``hash()``) and cheap."""
    key = zlib.crc32(f"{request_id}#{index}".encode())
    return (key * 2654435761 + position * 40503) % vocab_size


def hashed_tokens(vocab_size: int) -> TokenSource:
    """The default token source: each sequence's next :func:`hashed_token`."""

    def next_token(seq: Sequence) -> int:
        return hashed_token(vocab_size, seq.request_id, seq.index, seq.num_output_tokens)

    return next_token


def hashed_reply(vocab_size: int, request_id: str, num_tokens: int) -> list[int]:
    """The reply a request's first sample gets, known before the run (a simulated chat client
    resends it in the next turn)."""
    return [hashed_token(vocab_size, request_id, 0, i) for i in range(num_tokens)]


class SimEngine(EngineCore):
    """See the module docstring."""

    def __init__(
        self,
        profile: SimProfile,
        config: EngineConfig | None = None,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
        *,
        sleep: bool = False,
        token_source: TokenSource | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size`` narrows the profile's (a served replica: its tokenizer's ids only)."""
        config = config or EngineConfig()
        check_max_model_len(config.max_model_len, profile.max_model_len)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif config.kv_cache_memory_bytes is not None:
            per_block = profile.kv_bytes_per_token * config.block_size
            num_blocks = max(1, config.kv_cache_memory_bytes // per_block)
        else:
            num_blocks = profile.default_num_blocks(config.block_size)
        super().__init__(config, config.model_fingerprint or profile.fingerprint,
                         vocab_size or profile.vocab_size, (), profile.max_model_len,
                         num_blocks, on_kv_events)
        self.profile = profile
        slots = int(config.kv_offloading_size * 2**30) // self.block_bytes
        if slots:  # the real engine's tiers, bookkeeping only: no contents to move
            rate = profile.host_load_bytes_per_s / profile.kv_bytes_per_token  # modelled
            self.attach_tiers(TieredKV(self.kv, None, HostTier(slots), None, self.block_bytes,
                                       rates={HOST: rate}))
        self._loaded_bytes = 0.0  # loaded from the host tier by the steps modelled so far
        self.sleep = sleep
        self.next_token = token_source or hashed_tokens(self.vocab_size)
        self.clock_s = 0.0  # modelled time of every step so far

    # ----------------------------------------------------------------- the step

    def _execute(self, sched: SchedulerOutput, copies: list[tuple[int, int]],
                 outputs: list[RequestOutput]) -> float:
        """"Run" the batch in its modelled time (no block contents: nothing to copy) and append
        one token per sample whose prompt is done; returns the modelled seconds."""
        seconds = self.step_seconds(sched)
        sampled = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        targets, _ = self._fork_sampled(sampled)
        self._append_tokens(((seq, self.next_token(seq), None) for seq in targets), outputs)
        self.clock_s += seconds
        if self.sleep:
            time.sleep(seconds)
        return seconds

    def describe_compute(self) -> str:
        return "simulated"

    @property
    def block_bytes(self) -> int:
        return self.profile.kv_bytes_per_token * self.block_size

    def step_seconds(self, sched: SchedulerOutput) -> float:
        """The profile's time for this batch (call before the tokens are counted computed),
        with the host tier's loads since the last step."""
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            computed = seq.num_computed_tokens
            if n == 1 and computed + 1 == seq.num_tokens and seq.num_output_tokens:
                decodes.append(seq.num_tokens)
            else:
                prefills.append((n, computed))
        load_s = 0.0
        if self.tiers is not None:
            loaded = self.tiers.counters.loaded_bytes.get(HOST, 0)
            load_s = (loaded - self._loaded_bytes) / self.profile.host_load_bytes_per_s
            self._loaded_bytes = loaded
        return load_s + self.profile.step_seconds(prefills, decodes)

    def _may_stop(self, req: EngineRequest, seq: Sequence) -> bool:
        """The token source ignores min_tokens (the real sampler masks stops), so hold it here."""
        return seq.num_output_tokens >= req.params.min_tokens
