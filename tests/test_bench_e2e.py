"""`bench compare` end to end on the real local cluster (Ray Serve, Redis, built-in model),
launched with the shared launcher: the JSON and a PNG come out, and the figures are the ones
the cluster reports (token counts, cached tokens, the worker header)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve.bench.cli import main

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_compare_on_the_local_cluster(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "res"
    rc = main([
        "compare", "--policies", "prefix", "--num-workers", "2", "--model-path", "prefixserve-tiny",
        "--cluster-option", "max_num_seqs=8", "--cluster-option", "num_blocks=256",
        "--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "4",
        "--system-len", "96", "--question-len", "16", "--output-len", "6", "--ignore-eos",
        "--max-concurrency", "1", "--warmup", "1", "--result-dir", str(out),
        "--label", "e2e", "--save-detailed", "--no-progress",
    ])
    assert rc == 0
    assert "Prefix hit rate" in capsys.readouterr().out
    doc = json.loads((out / "prefix@inf.json").read_text())
    assert doc["completed"] == 8 and doc["failed"] == 0
    assert doc["total_input_tokens"] == 8 * 112
    assert doc["total_output_tokens"] == 8 * 6
    assert doc["mean_ttft_ms"] > 0 and doc["mean_tpot_ms"] > 0
    # vLLM's setup fields, and its default p99 of TTFT, TPOT and ITL
    assert doc["backend"] == "openai" and doc["model_id"] and doc["request_rate"] == "inf"
    assert doc["max_concurrency"] == 1 and doc["max_concurrent_requests"] == 1
    assert doc["p99_ttft_ms"] >= doc["median_ttft_ms"] and "p99_itl_ms" in doc
    # the machine readings of the cluster's process tree (bench/load/machine.py)
    assert doc["own_cpu_cores"] > 0 and doc["own_rss_mib"] > 100
    assert len(doc["requests"]) == 8
    assert sum(doc["per_worker_requests"].values()) == 8
    # One request at a time, so prefix routing keeps each group on the worker that holds its
    # system prompt: only each group's first request misses its 6 whole blocks (96 tokens).
    assert doc["total_cached_tokens"] >= 6 * 96
    assert (out / "e2e-ttft-cdf.png").read_bytes()[:4] == b"\x89PNG"
