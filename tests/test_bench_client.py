"""The client and load driver end to end against a real local HTTP server with scripted SSE."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from prefixserve.bench.cli import main
from prefixserve.bench.load.client import ClientConfig, Prompt, make_http_client, send
from prefixserve.bench.load.load import LoadShape, arrival_offsets, run_load
from prefixserve.bench.load.metrics import RequestResult
from prefixserve.bench.load.runner import RunSpec, run_once
from prefixserve.bench.load.workloads import MultiTurn, RandomPrompts, SharedPrefix, Tokens

FIRST_DELAY = 0.25
GAP = 0.05


def _chunk(text: str, chat: bool) -> dict:
    if chat:
        return {"object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


class Handler(BaseHTTPRequestHandler):
    """Scripts a stream from the prompt's first token id: 1 ok, 2 error event, 3 HTTP 400."""

    protocol_version = "HTTP/1.0"         # the body ends when the connection closes
    bodies: ClassVar[list[dict]] = []
    live = 0
    peak = 0
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            cls.live += 1
            cls.peak = max(cls.peak, cls.live)
        try:
            self._respond(body)
        finally:
            with cls.lock:
                cls.live -= 1

    def _respond(self, body: dict) -> None:
        chat = "messages" in body          # a chat request streams like a prompt of ones
        if chat:
            body["prompt"] = [1] * len(body["messages"][0]["content"].encode())
        mode = body["prompt"][0]
        if mode == 3:
            err = {"error": {"message": "prompt too long", "type": "BadRequestError"}}
            self._head(400, "application/json")
            self.wfile.write(json.dumps(err).encode())
            return
        self._head(200, "text/event-stream", worker=f"replica-{len(body['prompt']) % 2}")
        self._raw(b": ping\n\n")
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        self._event(role)
        time.sleep(FIRST_DELAY)
        if mode == 2:
            self._event({"error": {"message": "engine died", "type": "InternalServerError"}})
            return
        n = body["max_tokens"]
        for i in range(n):
            if i:
                time.sleep(GAP)
            line = f"data: {json.dumps(_chunk(f'tok{i} ', chat))}\n\n".encode()
            self._raw(line[:7])           # split the line across network writes
            time.sleep(0.002)
            self._raw(line[7:])
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}
        self._event({"choices": [], "usage": usage})
        self._raw(b"data: [DONE]\n\n")

    def _head(self, code: int, ctype: str, worker: str | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        if worker:
            self.send_header("x-prefixserve-worker", worker)
        self.end_headers()

    def _event(self, data: dict) -> None:
        self._raw(f"data: {json.dumps(data)}\n\n".encode())

    def _raw(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()


@pytest.fixture()
def server() -> Iterator[str]:
    Handler.bodies, Handler.live, Handler.peak = [], 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


async def _send(url: str, prompt: Prompt) -> object:
    cfg = ClientConfig(base_url=url, model="m", ignore_eos=True)
    async with make_http_client(cfg) as http:
        return await send(http, cfg, prompt, request_id="r1")


async def test_stream_timings_counts_and_worker(server: str) -> None:
    r = await _send(server, Prompt(tokens=[1, 5, 6], output_len=4))
    assert r.success, r.error
    # Lower bounds only: a loaded machine may stretch any time.
    assert r.ttft >= FIRST_DELAY  # the role-only chunk does not count
    assert len(r.itl) == 3 and all(g >= GAP * 0.8 for g in r.itl)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.output_tokens == 4 and r.prompt_len == 3 and r.cached_tokens == 1
    assert r.worker == "replica-1"
    body = Handler.bodies[0]
    assert body["prompt"] == [1, 5, 6] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True


async def test_error_event_and_http_error_fail_the_request(server: str) -> None:
    r = await _send(server, Prompt(tokens=[2, 0], output_len=3))
    assert not r.success and r.error == "engine died"
    r = await _send(server, Prompt(tokens=[3], output_len=3))
    assert not r.success and r.error.startswith("HTTP 400") and "prompt too long" in r.error


async def test_connection_refused_is_a_failed_result() -> None:
    r = await _send("http://127.0.0.1:9", Prompt(tokens=[1], output_len=2))
    assert not r.success and "Connect" in r.error


async def test_closed_loop_run_respects_concurrency_and_warmup(server: str) -> None:
    class Ones(Tokens):
        def run(self, n: int, *key: int) -> list[int]:
            return [1, *super().run(n - 1, *key)]      # mode 1: a normal stream

    spec = RunSpec(ClientConfig(base_url=server), LoadShape(max_concurrency=3),
                   Ones(vocab_size=100, seed=1), warmup=2, slos={"ttft": 5000.0},
                   progress=False)
    workload = SharedPrefix(num_groups=2, prompts_per_group=4, system_len=8, question_len=3,
                            output_len=2).sessions
    run = await run_once(spec, workload, label="t")
    s = run.summary
    assert len(Handler.bodies) == 10                     # 2 warm-up + 8 measured
    assert s["completed"] == 8 and s["failed"] == 0
    assert Handler.peak == 3 and s["max_concurrent_requests"] <= 3
    assert s["max_concurrency"] == 3 and s["request_rate"] == math.inf
    assert s["backend"] == "openai" and s["model_id"] is None and s["num_prompts"] == 8
    # RunSpec's defaults are vLLM's: p99 of TTFT, TPOT and ITL
    assert sorted(k for k in s if k.startswith("p9")) == ["p99_itl_ms", "p99_tpot_ms",
                                                          "p99_ttft_ms"]
    assert s["prefix_hit_rate"] == pytest.approx(5 / 11)     # the fake caches half the prompt
    assert s["per_worker_requests"] == {"replica-1": 8}
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert s["mean_ttft_ms"] >= FIRST_DELAY * 1000


def test_cli_sweep_writes_json_and_plots(server: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "res"
    rc = main(["run", "--base-url", server, "--workload", "random", "--num-prompts", "4",
               "--input-len", "5", "--output-len", "3", "--vocab-size", "2", "--min-token-id",
               "1", "--request-rate", "50,inf", "--max-concurrency", "2", "--burstiness", "0.5",
               "--model", "m-1", "--goodput", "ttft:5000", "--metric-percentiles", "50,99.9",
               "--percentile-metrics", "ttft,e2el", "--save-detailed", "--result-dir", str(out),
               "--label", "fake", "--no-progress"])
    assert rc == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["fake-ttft-cdf.png", "fake-vs-rate.png", "fake-worker-load.png",
                     "fake@50.json", "fake@inf.json"]
    doc = json.loads((out / "fake@50.json").read_text())
    # vLLM `bench serve`'s result fields, with its names and meanings
    for key in ("date", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                "request_rate", "burstiness", "max_concurrency", "duration", "completed",
                "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput",
                "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls",
                "latencies", "start_times", "errors"):
        assert key in doc, key
    assert re.fullmatch(r"\d{8}-\d{6}", doc["date"])            # vLLM's %Y%m%d-%H%M%S
    assert doc["backend"] == "openai" and doc["label"] == "fake@50"
    assert doc["model_id"] == "m-1" and doc["tokenizer_id"] is None
    assert doc["num_prompts"] == 4 and doc["completed"] == 4
    assert doc["request_rate"] == 50 and doc["burstiness"] == 0.5
    assert doc["max_concurrency"] == 2 and 1 <= doc["max_concurrent_requests"] <= 2
    # pNN only for the chosen percentiles of the chosen metrics; mean/median/std for all four
    assert sorted(k for k in doc if re.fullmatch(r"p[\d.]+_\w+_ms", k)) == [
        "p50_e2el_ms", "p50_ttft_ms", "p99.9_e2el_ms", "p99.9_ttft_ms"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            assert f"{stat}_{m}_ms" in doc, (stat, m)
    assert doc["p99.9_ttft_ms"] >= doc["p50_ttft_ms"] >= FIRST_DELAY * 1000
    # prefixserve's own figures, under their own names
    assert doc["per_worker_requests"] == {"replica-1": 4}
    assert doc["prefix_hit_rate"] is not None and "total_cached_tokens" in doc
    assert len(doc["requests"]) == 4 and doc["requests"][0]["ttft"] >= FIRST_DELAY
    assert doc["input_lens"] == [5] * 4 and doc["output_lens"] == [3] * 4
    assert min(doc["ttfts"]) >= FIRST_DELAY and all(len(i) == 2 for i in doc["itls"])
    assert all(lat >= ttft for lat, ttft in zip(doc["latencies"], doc["ttfts"], strict=True))
    assert len(doc["start_times"]) == 4
    inf = json.loads((out / "fake@inf.json").read_text())
    assert inf["request_rate"] == "inf" and inf["label"] == "fake@inf"
    assert (out / "fake-vs-rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    for row in ("Maximum request concurrency", "Peak concurrent requests", "P50 TTFT (ms)",
                "P99.9 TTFT (ms)", "P99.9 E2E latency (ms)", "Mean ITL (ms)"):
        assert row in printed, row
    assert "P99.9 ITL" not in printed and "P99 TTFT" not in printed


async def test_duration_bound_stops_issuing(server: str) -> None:
    # One at a time, each request takes at least FIRST_DELAY (about 0.35 s in all): a 0.5 s
    # bound lets one or two of the ten start (the first alone where setting up is slow), and
    # each that starts completes. No upper bound on any time: the machine may be loaded.
    spec = RunSpec(ClientConfig(base_url=server), LoadShape(max_concurrency=1, duration_s=0.5),
                   Tokens(vocab_size=2, min_id=1), progress=False)
    run = await run_once(spec, RandomPrompts(num_requests=10, input_len=4, output_len=3).sessions)
    assert 1 <= run.summary["completed"] <= 2
    assert len(Handler.bodies) == run.summary["completed"]
    assert run.summary["duration"] >= 0.5


async def test_open_loop_follows_arrivals_and_turns_wait_for_replies() -> None:
    sent: list[tuple[str, float]] = []

    async def fake_send(prompt: Prompt, rid: str, at: float) -> RequestResult:
        sent.append((rid, at))
        await asyncio.sleep(0.1)
        return RequestResult(success=True, request_id=rid, start_time=at, latency=0.1)

    sessions = RandomPrompts(num_requests=4, input_len=2).sessions(Tokens(vocab_size=10))
    shape = LoadShape(request_rate=4.0, seed=5)
    await run_load(sessions, fake_send, shape, progress=False)
    expected = arrival_offsets(4, 4.0, 1.0, seed=5)
    got = dict(sent)
    for i, t in enumerate(expected):
        assert got[f"{i}-0"] == pytest.approx(t, abs=0.08)

    sent.clear()
    chat = MultiTurn(num_users=2, turns=3, system_len=2, user_len=2, output_len=2,
                     think_time_s=0.2).sessions(Tokens(vocab_size=10))
    outcome = await run_load(chat, fake_send, LoadShape(), progress=False)
    assert len(outcome.results) == 6
    at = dict(sent)
    for u in range(2):
        for t in (1, 2):       # previous reply (0.1 s) + think time (0.2 s)
            assert at[f"{u}-{t}"] - at[f"{u}-{t - 1}"] == pytest.approx(0.3, abs=0.08)


def test_chat_endpoint_sends_decoded_text(server: str, tmp_path: Path) -> None:
    from prefixserve.workers.builtin import ensure_builtin_model

    model = ensure_builtin_model()
    rc = main(["run", "--base-url", server, "--endpoint", "/v1/chat/completions",
               "--tokenizer", str(model), "--workload", "random", "--num-prompts", "2",
               "--input-len", "6", "--output-len", "2", "--min-token-id", "65",
               "--vocab-size", "91", "--result-dir", str(tmp_path / "res"), "--no-plots",
               "--no-progress"])
    assert rc == 0
    sent = [b["messages"] for b in Handler.bodies]
    assert len(sent) == 2
    for messages in sent:
        (msg,) = messages
        assert msg["role"] == "user" and len(msg["content"]) == 6 and msg["content"].isupper()
    doc = json.loads((tmp_path / "res" / "random@inf.json").read_text())
    assert doc["completed"] == 2 and doc["total_output_tokens"] == 4
    assert doc["backend"] == "openai-chat" and doc["tokenizer_id"] == str(model)
    assert doc["max_concurrency"] is None             # unlimited
