"""Decode steps padded to captured (batch, width) buckets (`workers.decode_graphs`).

Off a GPU the buckets, static buffers and padding run eagerly, so everything but the capture call
is checked here against transformers and against the engine's ordinary step; on CUDA the last
test replays real graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine import hf_greedy, prompts, write_checkpoint

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.attention.metadata import AttentionMetadata
from prefixserve.workers.attention.torch_sdpa import TorchSDPABackend
from prefixserve.workers.decode_graphs import (
    DecodeGraphs,
    StaticDecodeMetadata,
    batch_buckets,
    bucket,
    graphs_by_default,
    width_buckets,
)
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.kv_tensor import allocate_kv_cache
from prefixserve.workers.models.loader import load_model

BLOCK = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    return path, write_checkpoint(path, "llama")


def sdpa_model(path: Path, device: str = "cpu") -> torch.nn.Module:
    model = load_model(path, "float32", device)
    model.attention = TorchSDPABackend()  # what a GPU gets; the CPU's default is its kernel
    return model


def graph_engine(path: Path, device: str = "cpu", **kw) -> LLMEngine:
    config = EngineConfig(device=device, block_size=BLOCK, num_blocks=64, **kw)
    return LLMEngine(sdpa_model(path, device), config, "fp", decode_graphs=True)


def test_buckets_are_vllms_sizes_and_hold_every_step() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    assert width_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert width_buckets(1) == [1]
    sizes = batch_buckets(20)
    assert [bucket(sizes, n) for n in (1, 3, 4, 5, 16, 17, 20, 21)] == [
        1, 4, 4, 8, 16, 20, 20, None]


def test_greedy_through_padded_buckets_matches_transformers(llama) -> None:
    """Five sequences finishing one after another, the longest prompt first, decode at 5, 4,
    3 (one padded row), 2 and 1 in tables of 16, 8 and 4 blocks; a repeat hits the prefix
    cache."""
    path, model = llama
    eng = graph_engine(path, max_num_seqs=5)
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.batches == [1, 2, 4, 5]
    batch = prompts(1, 7, 16, 23, 40)
    lengths = [15, 12, 9, 6, 3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    results = eng.generate(batch, params)
    for p, n, r in zip(batch, lengths, results, strict=True):
        assert r.samples[0].token_ids == hf_greedy(model, p, n)
    buckets = set(graphs.graphs)
    assert {b for b, _ in buckets} == {1, 2, 4, 5}
    assert {w for _, w in buckets} == {4, 8, 16}
    (hit,) = eng.generate([batch[-1]], params[-1])
    assert hit.num_cached_tokens == 36  # the last block recomputes the prompt's last token
    assert hit.samples[0].token_ids == results[-1].samples[0].token_ids
    assert eng.kv.num_free_blocks == eng.kv.num_total_blocks == 64
    assert eng.kv_cache.shape[2] == 65  # the scratch block, outside the pool
    assert eng.describe_compute().endswith(", decode graphs")


def decode_meta(contexts: list[int], tables: list[list[int]]) -> AttentionMetadata:
    return AttentionMetadata.build([1] * len(contexts), contexts, tables, BLOCK)


def test_a_padded_step_writes_only_its_own_slots_and_the_scratch_block(llama) -> None:
    """A step of four fills the bucket; the next step of three pads row 3, which must not
    write into the fourth sequence's slot again (its blocks may belong to another sequence by
    then), and the logits equal an eager step's."""
    path, _ = llama
    model = sdpa_model(path)
    num_blocks, scratch = 16, 16
    kv = allocate_kv_cache(model.config, num_blocks + 1, BLOCK, "float32", "cpu")
    graphs = DecodeGraphs(model, kv, BLOCK, max_num_seqs=4, max_model_len=64,
                          scratch_block=scratch)
    tables = [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9]]
    contexts = [6, 10, 3, 14]
    for t in tables:  # some earlier KV in every block
        kv[:, :, t] = torch.randn_like(kv[:, :, t])
    ids = torch.tensor([5, 9, 13, 17])
    meta = decode_meta(contexts, tables)
    graphs.run(ids, meta.positions(), meta)
    kv[:, :, tables[3]] = 0  # the fourth finished; its blocks went to a sequence not yet run
    three = decode_meta([c + 1 for c in contexts[:3]], tables[:3])
    before = kv.clone()
    logits = graphs.run(ids[:3], three.positions(), three)
    eager = model(ids[:3], three.positions(), three, before.clone())
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    changed = (kv != before).any(-1).any(-1).any(0).any(0).nonzero()  # [block, offset]
    written = {(int(s) // BLOCK, int(s) % BLOCK) for s in three.slot_mapping}
    assert {(int(b), int(o)) for b, o in changed} - {(scratch, 0)} == written
    assert (graphs.slot_mapping[3:] == scratch * BLOCK).all()
    with pytest.raises(RuntimeError, match="host"):
        StaticDecodeMetadata(*(three.slot_mapping, three.query_start_loc, three.context_lens,
                               three.block_tables, three.logits_indices)).host_lens()


def test_prefill_and_oversized_steps_run_eagerly(llama) -> None:
    path, _ = llama
    model = sdpa_model(path)
    kv = allocate_kv_cache(model.config, 33, BLOCK, "float32", "cpu")
    graphs = DecodeGraphs(model, kv, BLOCK, max_num_seqs=2, max_model_len=16, scratch_block=32)
    assert graphs.widths == [1, 2, 4]
    assert graphs.fits(decode_meta([3, 16], [[0], [1, 2, 3, 4]]))
    assert not graphs.fits(decode_meta([3, 5, 7], [[0], [1, 2], [3, 4]]))  # 3 > 2 sequences
    assert not graphs.fits(decode_meta([20], [[0, 1, 2, 3, 4]]))  # 5 blocks > 4
    prefill = AttentionMetadata.build([1, 4], [3, 4], [[0], [1]], BLOCK)
    assert not graphs.fits(prefill)
    unsampled = AttentionMetadata.build([1, 1], [3, 4], [[0], [1]], BLOCK, logits_indices=[1])
    assert not graphs.fits(unsampled)
    long = DecodeGraphs(model, kv, BLOCK, max_num_seqs=2, max_model_len=10_000, scratch_block=32)
    assert long.widths[-1] == 8192 // BLOCK  # longer contexts decode eagerly, as vLLM's


def test_graphs_are_on_by_default_only_on_a_gpu_with_the_torch_backend(llama) -> None:
    path, _ = llama
    model = sdpa_model(path)
    assert not graphs_by_default(model, torch.device("cpu"), enforce_eager=False)
    assert graphs_by_default(model, torch.device("cuda"), enforce_eager=False)
    assert not graphs_by_default(model, torch.device("cuda"), enforce_eager=True)
    kernel_model = load_model(path, "float32", "cpu")
    if not isinstance(kernel_model.attention, TorchSDPABackend):
        assert not graphs_by_default(kernel_model, torch.device("cuda"), enforce_eager=False)
        with pytest.raises(ValueError, match="torch_sdpa"):
            DecodeGraphs(kernel_model, allocate_kv_cache(kernel_model.config, 3, BLOCK,
                                                         "float32", "cpu"), BLOCK, 2, 8, 2)
    eng = LLMEngine(model, EngineConfig(device="cpu", block_size=BLOCK, num_blocks=8), "fp")
    assert eng.runner.graphs is None and eng.kv_cache.shape[2] == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_transformers_greedy(llama) -> None:
    path, model = llama
    eng = LLMEngine.from_pretrained(path, EngineConfig(device="cuda", dtype="float32",
                                                       block_size=BLOCK, num_blocks=64,
                                                       max_num_seqs=5))
    assert eng.runner.graphs is not None
    batch = prompts(1, 7, 16, 23, 40)
    lengths = [3, 6, 9, 12, 15]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    for p, n, r in zip(batch, lengths, eng.generate(batch, params), strict=True):
        assert r.samples[0].token_ids == hf_greedy(model, p, n)
    assert eng.runner.graphs.graphs
