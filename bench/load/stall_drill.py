"""A frozen-worker drill: stop one worker process mid-stream (SIGSTOP, as a hung driver or a stuck
GIL would leave it), measure how the cluster copes, then let it go on (SIGCONT).

Starts a local cluster (private Redis, Ray, the app), streams a long completion, stops the worker
serving it, and prints how long the stream took to end and how, how long a request sent during
the freeze with the same prefix took and who served it, a later request's latency, `/ready`
during the freeze, and how soon after SIGCONT `/ready` was 200 again. Example::

    python -m prefixserve.bench.load.stall_drill --num-workers 2 --worker-stall-timeout-s 20

Stop it for longer than Serve's health check allows (about 90 s) and Serve replaces the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time

import httpx

from prefixserve.bench.load.launch import APP_NAME, local_cluster, shutdown
from prefixserve.bench.load.machine import cpu_name
from prefixserve.cluster.render import WORKER_HEADER


def worker_pids(num_workers: int) -> dict[str, int]:
    """Replica id -> process id of every worker (stats calls go to any replica)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMWorker", APP_NAME)
    pids: dict[str, int] = {}
    while len(pids) < num_workers:
        stats = handle.stats.remote().result(timeout_s=60)
        pids[stats["worker"]] = stats["pid"]
    return pids


def drill(base_url: str, num_workers: int, max_tokens: int) -> dict[str, str]:
    """The figures of one drill, as printable text."""
    pids = worker_pids(num_workers)
    prompt = "the stopped worker holds this prefix. " * 8
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    out: dict[str, str] = {}
    with httpx.Client(base_url=base_url, timeout=600) as client, \
            client.stream("POST", "/v1/completions", json=body) as stream:
        stopped = stream.headers[WORKER_HEADER]
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(pids[stopped], signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            start = time.monotonic()
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            by = "another" if r.headers.get(WORKER_HEADER) != stopped else "the stopped"
            out["request sent during the freeze"] = (
                f"{r.status_code} after {time.monotonic() - start:.1f} s, from {by} worker")
            rest = [line for line in lines if line.startswith("data: ")]
            ended = time.monotonic() - frozen_at
            last = json.loads(rest[-2].removeprefix("data: ")) if len(rest) > 1 else {}
            code = last.get("error", {}).get("code") if "error" in last else "no error event"
            out["stream under way ended"] = f"after {ended:.1f} s: {code}, then {rest[-1]}"
            start = time.monotonic()
            r = client.post("/v1/completions", json={"prompt": prompt + " later",
                                                     "max_tokens": 4})
            by = "another" if r.headers.get(WORKER_HEADER) != stopped else "the stopped"
            out["a later request"] = (f"{r.status_code} after {time.monotonic() - start:.2f} s, "
                                      f"from {by} worker")
            ready = client.get("/ready")
            out["/ready during the freeze"] = f"{ready.status_code} {ready.json()['workers']}"
        finally:
            os.kill(pids[stopped], signal.SIGCONT)
        resumed = time.monotonic()
        while client.get("/ready").status_code != 200:
            time.sleep(0.2)
        out["/ready 200 again"] = f"{time.monotonic() - resumed:.1f} s after SIGCONT"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="prefixserve-tiny")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--worker-stall-timeout-s", type=float, default=None,
                        help="the ingress's progress deadline (default: the config's)")
    parser.add_argument("--max-tokens", type=int, default=1500,
                        help="the long stream's length: it must outlast the deadline")
    args = parser.parse_args(argv)
    options = {"model": args.model, "num_workers": args.num_workers, "cpus_per_worker": 0.5}
    if args.worker_stall_timeout_s is not None:
        options["worker_stall_timeout_s"] = args.worker_stall_timeout_s
    try:
        with local_cluster(**options) as launched:
            deadline = launched.config.ingress.worker_stall_timeout_s
            print(f"{args.num_workers} workers of {launched.model}, worker_stall_timeout_s="
                  f"{deadline:g}, on {platform.machine()} {cpu_name()}")
            for what, figure in drill(launched.base_url, args.num_workers,
                                      args.max_tokens).items():
                print(f"  {what:32} {figure}")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
