"""Locust users for teams that drive load with Locust (`pip install locust`; optional).

    locust -f bench/load/locustfile.py --host http://127.0.0.1:8000 --workload shared-prefix \
        --vocab-size 259 --output-len 64 -u 16 -r 4 --headless -t 2m

Each user streams completions with token-id prompts from the same workloads as `bench run`.
Besides the request itself (`POST completion`, its response time set to the E2E latency), every
request fires two custom entries, `TTFT` and `TPOT` (response times in ms), so Locust's tables,
charts and CSVs show them with its usual percentiles.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

try:
    from locust import HttpUser, events, task
except ImportError as exc:                   # locust is optional, not a dependency
    raise ImportError("bench/load/locustfile.py needs locust: pip install locust") from exc

from prefixserve.bench.load.client import ClientConfig, Prompt, build_body
from prefixserve.bench.load.sse import StreamReader
from prefixserve.bench.load.workloads import RandomPrompts, SharedPrefix, Tokens

_prompts: itertools.cycle | None = None


@events.init_command_line_parser.add_listener
def _add_args(parser: Any) -> None:
    parser.add_argument("--workload", choices=("shared-prefix", "random"), default="shared-prefix")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--model-name", default="")
    parser.add_argument("--bench-seed", type=int, default=0)


@events.test_start.add_listener
def _make_prompts(environment: Any, **_: Any) -> None:
    global _prompts
    o = environment.parsed_options
    tok = Tokens(o.vocab_size, o.bench_seed)
    if o.workload == "random":
        sessions = RandomPrompts(o.num_groups * o.prompts_per_group, o.input_len,
                                 o.output_len).sessions(tok)
    else:
        sessions = SharedPrefix(o.num_groups, o.prompts_per_group, o.system_len, o.question_len,
                                o.output_len).sessions(tok)
    _prompts = itertools.cycle([s.turns[0] for s in sessions])


class CompletionUser(HttpUser):
    """Streams one completion per task and reports TTFT/TPOT as extra request types."""

    @task
    def complete(self) -> None:
        assert _prompts is not None
        prompt: Prompt = next(_prompts)
        opts = self.environment.parsed_options
        body = build_body(ClientConfig(model=opts.model_name, ignore_eos=True), prompt)
        start = time.perf_counter()
        reader = StreamReader()
        with self.client.post("/v1/completions", data=json.dumps(body), stream=True,
                              headers={"Content-Type": "application/json"},
                              name="completion", catch_response=True) as resp:
            error = _read(resp, reader) if resp.status_code == 200 else resp.text[:200]
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000   # E2E
            times, usage = reader.content_times, reader.usage
            if error or not times:
                resp.failure(error or "no content")
                return
            resp.success()
        ttft_ms = (times[0] - start) * 1000
        self._fire("TTFT", ttft_ms)
        out = usage.get("completion_tokens") or len(times)
        if out > 1:
            self._fire("TPOT", (times[-1] - times[0]) * 1000 / (out - 1))

    def _fire(self, kind: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name="completion", response_time=ms, response_length=0,
            exception=None, context={})


def _chunks(resp: Any) -> Iterator[bytes]:
    """Bytes as they arrive: urllib3's read1 returns after one socket read (iter_content with
    chunk_size=None would wait for EOF on a body that is not chunk-encoded)."""
    read1 = getattr(resp.raw, "read1", None)
    if read1 is None:
        yield from resp.iter_content(chunk_size=None)
        return
    while chunk := read1(65536):
        yield chunk


def _read(resp: Any, reader: StreamReader) -> str:
    for chunk in _chunks(resp):
        if reader.feed(chunk, time.perf_counter()):
            return reader.error
    return reader.finish()
