"""Which engine a model name starts: a checkpoint (safetensors or GGUF, local or a registry
package) runs the real engine, ``sim:<profile>`` the simulated one."""

from __future__ import annotations

from collections.abc import Callable

from prefixserve.router.events import KVEvent
from prefixserve.workers.checkpoints import resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.sim.engine import SimEngine
from prefixserve.workers.sim.profiles import is_sim_model, profile_for


def load_engine(
    model: str, config: EngineConfig, on_kv_events: Callable[[list[KVEvent]], None]
) -> LLMEngine | SimEngine:
    """The engine for `model`, resolved on this node (a GGUF converted once per node);
    ``sim:<profile>`` is a simulated engine whose steps sleep their modelled time, its token ids
    within the sim tokenizer's vocabulary (docs/simulation.md)."""
    if is_sim_model(model):
        profile = profile_for(model)
        return SimEngine(profile, config, on_kv_events, sleep=True,
                         vocab_size=profile.served_vocab_size)
    return LLMEngine.from_pretrained(resolve_checkpoint(model), config, on_kv_events)
