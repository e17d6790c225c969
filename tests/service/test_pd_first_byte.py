"""The P/D proxy's first-byte timeout (``--first-byte-timeout``) against scripted servers on loopback
(``faulty_backend.py``, no model): a server that accepts the connection and then sends nothing. A silent
prefill server leaves the prefill to the decode server; a silent decode server's request is tried once
more on another decode server, else answered 504 in OpenAI's error shape; each silence is a passive
health failure of the silent server."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import pytest
from faulty_backend import TEXT_CHUNKS, FaultyBackend, ThreadServer
from live_server import ROOT, stop_process

from tandem.cli import build_parser
from tandem.config import ConfigError
from tandem.router.pd import PDConfig, PDProxy, build_pd_app, pd_config_from_args

TIMEOUT_S = 0.5
BODY = {"model": "faulty", "prompt": "Once", "max_tokens": 3}


def route(modes: list[str], n_decode: int, body: dict, **config) -> tuple[httpx.Response, dict, list[FaultyBackend]]:
    """Sends ``body`` through a PDProxy over one prefill server and ``n_decode`` decode servers whose
    ``FaultyBackend`` modes are ``modes`` (prefill first); returns the client's answer, ``/backends`` and
    the servers (each with the requests it got)."""
    backends = [FaultyBackend() for _ in modes]
    for backend, mode in zip(backends, modes, strict=True):
        backend.mode = mode
    with ExitStack() as stack:
        urls = [stack.enter_context(ThreadServer(b.app)).url for b in backends]

        async def main() -> tuple[httpx.Response, dict]:
            proxy = PDProxy(PDConfig(prefill=(urls[0],), decode=tuple(urls[1:1 + n_decode]),
                                     first_byte_timeout_s=TIMEOUT_S, **config))
            app = httpx.ASGITransport(app=build_pd_app(proxy))
            async with httpx.AsyncClient(transport=app, base_url="http://router", timeout=30) as router:
                answer = await router.post("/v1/completions", json=body)
                await answer.aread()
                state = (await router.get("/backends")).json()
            await proxy.client.aclose()
            return answer, state

        try:
            answer, state = asyncio.run(main())
        finally:
            for b in backends:  # NOTE: let the stalled handlers end, so the servers can stop
                if b.loop is not None:
                    b.release_shadows()
    state["urls"] = urls
    return answer, state, backends


def test_a_silent_prefill_server_leaves_the_prefill_to_the_decode_server():
    answer, state, (prefill, decode) = route(["stall", "ok"], 1, BODY)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "".join(TEXT_CHUNKS)
    assert prefill.requests[0]["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert [r["body"] for r in decode.requests] == [BODY]  # the client's own body: it prefills itself
    health = state["health"][state["urls"][0]]
    assert health["consecutive_failures"] == 1 and health["state"] == "healthy"
    assert health["last_error"] is None  # counted, not yet ejected (--failure-threshold 3)
    counts = state["num_first_byte_timeouts"], state["num_prefill_unreachable"], state["num_decode_retries"]
    assert counts == (1, 1, 0)


def test_a_silent_decode_server_is_left_for_another_one_stream_intact():
    body = {**BODY, "stream": True}
    answer, state, (prefill, silent, other) = route(["ok", "stall", "ok"], 2, body)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == TEXT_CHUNKS
    assert len(silent.requests) == 1 and [r["body"] for r in other.requests] == [body]
    assert state["health"][state["urls"][1]]["consecutive_failures"] == 1
    assert state["health"][state["urls"][2]]["consecutive_failures"] == 0
    assert (state["num_first_byte_timeouts"], state["num_decode_retries"]) == (1, 1)
    assert state["outstanding"] == dict.fromkeys(state["urls"], 0)


def test_no_decode_server_left_is_a_504_and_a_passive_failure():
    answer, state, (_, silent) = route(["ok", "stall"], 1, BODY, failure_threshold=1)
    assert answer.status_code == 504
    url = state["urls"][1]
    assert answer.json() == {"error": {"message": f"no response byte within {TIMEOUT_S:g} s from the decode server "
                                                  f"{url}", "type": "gateway_timeout", "param": None,
                                       "code": "first_byte_timeout"}}
    assert len(silent.requests) == 1
    health = state["health"][url]
    assert health["state"] == "ejected" and health["ejections"] == 1  # --failure-threshold 1
    assert health["last_error"] == f"1 consecutive failures, the last: sent no response byte within {TIMEOUT_S:g} s"
    assert state["outstanding"] == dict.fromkeys(state["urls"], 0)


def test_two_silent_decode_servers_are_a_504_naming_both():
    answer, state, (_, first, second) = route(["ok", "stall", "stall"], 2, BODY)
    assert answer.status_code == 504 and answer.json()["error"]["message"] == (
        f"no response byte within {TIMEOUT_S:g} s from the decode server {state['urls'][1]} nor from "
        f"{state['urls'][2]}")
    assert (len(first.requests), len(second.requests)) == (1, 1)  # tried once more, not again


def test_the_flag_maps_onto_the_config_and_is_checked():
    args = build_parser().parse_args(["router", "--prefill", "http://p:1", "--decode", "http://d:1",
                                      "--first-byte-timeout", "7.5", "--failure-threshold", "2"])
    config = pd_config_from_args(args)
    assert (config.first_byte_timeout_s, config.failure_threshold, config.eject_s) == (7.5, 2, 2.0)
    default = pd_config_from_args(build_parser().parse_args(["router", "--prefill", "http://p:1", "--decode",
                                                             "http://d:1"]))
    assert default.first_byte_timeout_s == 0.0  # off, as for --backend routing
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--first-byte-timeout must be a finite number >= 0"):
            PDConfig(prefill=("http://p:1",), decode=("http://d:1",), first_byte_timeout_s=bad)


def test_the_pd_router_prints_its_listening_line_and_serves(tmp_path):
    """``tandem router --prefill/--decode`` printed nothing once it listened (the --backend router prints
    its ready line; scripts wait for it)."""
    backend = FaultyBackend()
    with ThreadServer(backend.app) as server:
        log_path = tmp_path / "pd_router.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "router", "--port", "0", "--prefill",
                                     server.url, "--decode", server.url, "--decode", "http://127.0.0.1:9"],
                                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
            try:
                deadline = time.monotonic() + 120
                while not (line := re.search(r"tandem router: listening on http://127\.0\.0\.1:(\d+) \((.*)\)\n",
                                             log_path.read_text())):
                    assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.1)
                assert line.group(2) == "P/D: 1 prefill, 2 decode servers"
                port = int(line.group(1))
                assert port != 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
            finally:
                stop_process(proc, log, 15.0)
