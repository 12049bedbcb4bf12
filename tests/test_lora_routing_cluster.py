"""Adapter-aware routing on a real Ray Serve deployment: two LLMWorker replicas with one LoRA
batch slot each (`max_loras` 1), two adapters, real Redis.

Its own cluster: what each worker holds in its slot is the state under test, so no other test
may have sent it an adapter first.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import peft
import pytest
import torch
import transformers
from ray import serve
from servekit import request_router, start_ray, stop_ray, wait_for

from prefixserve.cluster.app import request_router_config
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.adapter_slots import SlotReport
from prefixserve.router.adapters import adapter_identity
from prefixserve.router.index import IndexSettings
from prefixserve.router.request import GenerateRequest, TokenDelta
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.router.serve_compat import replica_key, routing_stats
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.deployment import worker_deployment

MODEL = "tiny"
BLOCK = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
_ids = itertools.count()
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two random PEFT adapters of the built-in model: name -> identity."""
    base = transformers.AutoModelForCausalLM.from_pretrained(ensure_builtin_model()).float()
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for seed, name in enumerate(("x", "y")):
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "lora_" in key:
                    p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
                        seed)))
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def handle(redis_server: LocalRedis, adapters: dict[str, str]):
    engine = {"block_size": BLOCK, "num_blocks": 128, "max_num_seqs": 8, "max_loras": 1,
              "lora_modules": adapters}
    start_ray(num_cpus=4)
    try:
        serve.start(proxy_location="Disabled")
        router = RouterSettings(model=MODEL, block_size=BLOCK, lookup_deadline_s=0.1,
                                check_interval_s=5.0, target_wait_s=2.0)
        deployment = worker_deployment(
            num_replicas=2, num_cpus=0.5, num_gpus=0, max_ongoing_requests=64,
            request_router_config=request_router_config(
                "prefix", redis_server.url, router, IndexSettings(), stats_period_s=0.5))
        app = deployment.bind(str(ensure_builtin_model()), engine, redis_server.url, MODEL,
                              stream_interval=1, drain_timeout_s=5.0, heartbeat_interval_s=0.2)
        yield serve.run(app, name="lora-routing", route_prefix=None)
    finally:
        stop_ray()


def run(handle, adapter: str | None) -> list[TokenDelta]:
    n = next(_ids)
    tokens = [(n * 37 + i) % 250 + 3 for i in range(3 * BLOCK)]  # no prefix in common
    request = GenerateRequest(f"req-{n}", tokens, GREEDY, lora=adapter)
    deltas = [d for d in handle.options(stream=True).generate.remote(request)
              if not d.keepalive]
    assert deltas[-1].finished and deltas[0].num_cached_tokens == 0
    return deltas


def test_with_one_slot_each_adapter_goes_to_the_worker_holding_it(
        handle, adapters: dict[str, str]) -> None:
    """The first adapter takes a worker; the second goes to the other, whose slot is free;
    from then on each adapter's requests (new prompts, no prefix to follow) go where it is
    held, and neither worker loads an adapter twice. The workers report their slots to the
    router through Serve's routing stats."""
    x, y = (adapter_identity(name, path) for name, path in adapters.items())
    where = {x: run(handle, x)[-1].worker}
    where[y] = run(handle, y)[-1].worker
    assert where[x] != where[y]
    for _ in range(3):
        for adapter in (x, y):
            assert run(handle, adapter)[-1].worker == where[adapter]
    assert run(handle, None)[-1].finished  # the base model runs beside either
    for adapter, worker in where.items():
        lora = handle.stats.remote(target_worker=worker).result()["lora"]
        assert (lora["resident"], lora["loads"], lora["evictions"]) == ((adapter,), 1, 0)
        assert lora["registered"] == 2 and lora["max_loras"] == 1

    router = request_router(handle)

    def reported() -> dict[str, tuple[str, ...]]:
        reports = {replica_key(r): SlotReport.of(routing_stats(r))
                   for r in router.curr_replicas.values()}
        return {w: r.resident for w, r in reports.items() if r is not None}

    assert wait_for(lambda: reported() == {w: (a,) for a, w in where.items()}, 10), reported()


def test_an_adapter_the_worker_lacks_is_read_from_its_path(handle, adapters: dict[str, str],
                                                           tmp_path: Path) -> None:
    """A request naming an adapter by identity and path (one loaded at run time) is served
    by a worker that never registered it; a path whose weights differ from the identity is
    refused."""
    import shutil
    shutil.copytree(adapters["x"], tmp_path / "late")
    late = adapter_identity("late", tmp_path / "late")
    n = next(_ids)
    request = GenerateRequest(f"late-{n}", list(range(3, 40)), GREEDY, lora=late,
                              lora_path=str(tmp_path / "late"))
    deltas = [d for d in handle.options(stream=True).generate.remote(request)
              if not d.keepalive]
    assert deltas[-1].finished and len(deltas[-1].token_ids) + len(deltas[0].token_ids) >= 1
    wrong = GenerateRequest(f"wrong-{n}", list(range(3, 40)), GREEDY,
                            lora=late.replace("@", "@0"), lora_path=str(tmp_path / "late"))
    with pytest.raises(Exception, match="weights at"):
        list(handle.options(stream=True).generate.remote(wrong))
