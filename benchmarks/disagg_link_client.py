"""The two halves of ``disagg_link.py`` that run inside the network namespaces: the measuring client (decode
side) and the raw-socket sender (prefill side). Not a tool of its own."""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import httpx


def metric(text: str, name: str) -> float:
    """Sum of the samples of the Prometheus series ``name`` (any labels) in an exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_healthy(url: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy in {timeout_s:.0f} s")


def prompt_ids(model: str, num_tokens: int) -> list[int]:
    from tandem.models.resolve import resolve_model_path  # noqa: PLC0415
    path = resolve_model_path(None if model == "default" else model, progress=False)
    vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    return [(13 * i + 7) % (vocab - 10) + 5 for i in range(num_tokens)]


def legs(client: httpx.Client, prefill: str, decode: str, body: dict) -> tuple[float, float]:
    """One request ``body`` through both legs (vLLM's kv_transfer_params exchange); seconds of each leg."""
    t0 = time.perf_counter()
    first = client.post(prefill + "/v1/completions", json={**body, "stream": False,
                                                           "kv_transfer_params": {"do_remote_decode": True}})
    first.raise_for_status()
    t1 = time.perf_counter()
    params = first.json()["kv_transfer_params"]
    second = client.post(decode + "/v1/completions", json={**body, "kv_transfer_params": params})
    second.raise_for_status()
    if second.json().get("kv_transfer_params", {}).get("remote_prefill") == "local_fallback":
        raise SystemExit("the decode side prefilled locally: the pull failed")
    return t1 - t0, time.perf_counter() - t1


def raw_copy(sock: socket.socket, num_bytes: int, buf: bytearray) -> float:
    """Seconds to receive ``num_bytes`` from the raw sender (one request on the kept connection ``sock``)."""
    view = memoryview(buf)[:num_bytes]
    t0 = time.perf_counter()
    sock.sendall(struct.pack("<Q", num_bytes))
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if not n:
            raise SystemExit("raw sender closed the connection")
        got += n
    return time.perf_counter() - t0


def client_main(args, ip_p: str, ip_d: str, http_port: int, raw_port: int) -> dict:
    prefill, decode = f"http://{ip_p}:{http_port}", f"http://{ip_d}:{http_port}"
    wait_healthy(prefill)
    wait_healthy(decode)
    prompt = prompt_ids(args.model, args.prompt_tokens)
    sock = socket.create_connection((ip_p, raw_port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with httpx.Client(timeout=600) as client:
        model = client.get(prefill + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        legs(client, prefill, decode, body)  # NOTE: computes the prompt once, connects, handshakes: not timed
        pulls, raws, ttfts, prefills, num_bytes = [], [], [], [], 0
        buf = bytearray()
        for _ in range(args.repeats):
            before = client.get(decode + "/metrics").text
            prefill_s, decode_s = legs(client, prefill, decode, body)
            after = client.get(decode + "/metrics").text
            num_bytes = int(metric(after, "tandem:kv_transfer_bytes_received_total")
                            - metric(before, "tandem:kv_transfer_bytes_received_total"))
            seconds = (metric(after, "tandem:kv_transfer_pull_seconds_total")
                       - metric(before, "tandem:kv_transfer_pull_seconds_total"))
            if len(buf) < num_bytes:
                buf = bytearray(num_bytes)
            raws.append(num_bytes / raw_copy(sock, num_bytes, buf) / 1e9)
            pulls.append(num_bytes / seconds / 1e9)
            ttfts.append(decode_s * 1e3)
            prefills.append(prefill_s * 1e3)
    return {"bytes": num_bytes, "pull_gbps": statistics.median(pulls), "raw_gbps": statistics.median(raws),
            "pull_gbps_all": pulls, "raw_gbps_all": raws, "decode_ttft_ms": statistics.median(ttfts),
            "prefill_ms": statistics.median(prefills)}


def raw_sender(host: str, port: int) -> None:
    """Serves ``raw_copy``, one connection at a time: per 8-byte request of N, sends N bytes from one
    preallocated buffer."""
    server = socket.create_server((host, port))
    buf = bytearray(1)
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while len(head := conn.recv(8, socket.MSG_WAITALL)) == 8:
                (n,) = struct.unpack("<Q", head)
                if len(buf) < n:
                    buf = bytearray(b"\x01" * n)
                conn.sendall(memoryview(buf)[:n])


if __name__ == "__main__" and sys.argv[1:2] == ["--raw-sender"]:
    raw_sender(sys.argv[2], int(sys.argv[3]))
