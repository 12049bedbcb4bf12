"""The client and load driver end to end against a real local HTTP server with scripted SSE."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from bench.cli import main
from bench.client import ClientConfig, Prompt, make_http_client, send
from bench.load import LoadShape, arrival_offsets, run_load
from bench.metrics import RequestResult
from bench.runner import RunSpec, run_once
from bench.workloads import MultiTurn, RandomPrompts, SharedPrefix, Tokens

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
    assert FIRST_DELAY <= r.ttft < FIRST_DELAY + 0.2      # role-only chunk does not count
    assert len(r.itl) == 3 and all(GAP * 0.8 <= g < GAP + 0.15 for g in r.itl)
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
    assert s["prefix_hit_rate"] == pytest.approx(5 / 11)     # the fake caches half the prompt
    assert s["per_worker_requests"] == {"replica-1": 8}
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert s["mean_ttft_ms"] >= FIRST_DELAY * 1000


def test_cli_sweep_writes_json_and_plots(server: str, tmp_path: Path) -> None:
    out = tmp_path / "res"
    rc = main(["run", "--base-url", server, "--workload", "random", "--num-prompts", "4",
               "--input-len", "5", "--output-len", "3", "--vocab-size", "2", "--min-token-id",
               "1", "--request-rate", "50,inf", "--max-concurrency", "2", "--goodput",
               "ttft:5000", "--save-detailed", "--result-dir", str(out), "--label", "fake",
               "--no-progress"])
    assert rc == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["fake-ttft-cdf.png", "fake-vs-rate.png", "fake-worker-load.png",
                     "fake@50.json", "fake@inf.json"]
    doc = json.loads((out / "fake@50.json").read_text())
    for key in ("duration", "completed", "failed", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
                "p90_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p90_itl_ms", "mean_e2el_ms",
                "request_goodput", "prefix_hit_rate", "per_worker_requests"):
        assert key in doc, key
    assert doc["completed"] == 4 and doc["request_rate"] == 50
    assert doc["per_worker_requests"] == {"replica-1": 4}
    assert len(doc["requests"]) == 4 and doc["requests"][0]["ttft"] >= FIRST_DELAY
    assert doc["input_lens"] == [5] * 4 and doc["output_lens"] == [3] * 4
    assert min(doc["ttfts"]) >= FIRST_DELAY and all(len(i) == 2 for i in doc["itls"])
    assert json.loads((out / "fake@inf.json").read_text())["request_rate"] == "inf"
    assert (out / "fake-vs-rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_duration_bound_stops_issuing(server: str) -> None:
    # One at a time, each request takes ~0.35 s: a 0.5 s bound lets exactly two start.
    spec = RunSpec(ClientConfig(base_url=server), LoadShape(max_concurrency=1, duration_s=0.5),
                   Tokens(vocab_size=2, min_id=1), progress=False)
    run = await run_once(spec, RandomPrompts(num_requests=10, input_len=4, output_len=3).sessions)
    assert run.summary["completed"] == 2 and len(Handler.bodies) == 2
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
    from workers.builtin import ensure_builtin_model

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
