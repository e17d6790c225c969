"""P/D disaggregation at equal cores: serving latency (TTFT, ITL, goodput) and KV transfer throughput, in one run.

1. Transfer: two engines in this process (a prefill engine with ``kv_role`` kv_producer, a decode engine's
   runner with a ``KVPuller``) on loopback: the prefill engine computes a long prompt once (its blocks held
   under a lease), then the decode side pulls those blocks ``--repeats`` times (the pull over ZeroMQ, the
   bytes on the data connection: sent from views of the held blocks, received straight into its own cache)
   while the prefill engine serves between its steps. After each pull the same number of bytes goes
   through a plain TCP socket (``RawSocket``: one connection, ``sendall`` from a thread, ``recv_into`` a
   preallocated buffer). The ratio pull / raw socket (of the medians) is the figure of merit.
2. Serving (unless ``--no-serving``): one co-located ``tandem serve`` on cores 0,1 (2 threads) against a
   prefill server on core 0 + a decode server on core 1 (1 thread each) behind ``tandem router --prefill
   --decode --disagg-min-prompt-tokens`` (short prompts go straight to decode), one set-up at a time.
   Load (``disagg_serving.py``): short-prompt chat streams (Poisson) alone, then the same with long prompts
   arriving (Poisson) at each ``--scales`` multiple of both rates. Reported per run: TTFT and ITL p50/p99
   of the short streams and of all requests, SLO attainment (TTFT and TPOT both met), and goodput as
   DistServe defines it: the highest request rate at which >= 90% of requests meet both SLOs.

    python benchmarks/disagg_bench.py --model default --prompt-tokens 2000 --repeats 5 [--synthetic] \
        [--long-tokens 2000 --short-rate 0.5 --long-rate 0.05 --scales 0.5,1,2 --window-s 60]
    python benchmarks/disagg_bench.py --model default --prompt-tokens 2000 --repeats 15 --synthetic --no-serving
        # the transfer only (part 1)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from tandem.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from tandem.disagg.consumer import KVPuller, PullJob
from tandem.disagg.identity import kv_identity
from tandem.engine.core import EngineCore
from tandem.models.resolve import resolve_model_path
from tandem.request import Request
from tandem.sampling_params import SamplingParams

try:
    from disagg_serving import add_serving_args, run_serving
except ImportError:  # NOTE: imported as benchmarks.disagg_bench
    from benchmarks.disagg_serving import add_serving_args, run_serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill_engine(model: Path, dtype: str, num_blocks: int) -> EngineCore:
    config = EngineConfig(model=ModelConfig(model=str(model), dtype=dtype), cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512),
                          kv_transfer=KVTransferConfig(kv_role="kv_producer", kv_port=free_port(), lease_ttl_s=600))
    return EngineCore(model, config, progress=False)


def prefill(core: EngineCore, num_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    vocab = core.runner.hf_config.vocab_size
    prompt = [(13 * i + 7) % (vocab - 10) + 5 for i in range(num_tokens)]
    core.add_request(Request("bench", prompt, params, max_tokens=1))
    while True:
        for out in core.step():
            if out.finish_reason is not None:
                return out.kv_transfer_params


def hold_blocks(core: EngineCore, num_tokens: int) -> dict:
    """``--synthetic``: blocks for ``num_tokens`` allocated and held under a lease without a forward pass
    (their bytes are whatever the cache holds; a transfer moves them the same), as a prefill leg would."""
    kv = core.scheduler.kv_cache_manager
    request = Request("synthetic", list(range(num_tokens)), SamplingParams(max_tokens=1), max_tokens=1)
    kv.allocate_slots(request, num_tokens)
    block_ids = kv.hold(request, "bench-lease")
    config = core.kv_connector.config
    return {"remote_block_ids": block_ids, "remote_block_generations": kv.block_generations(block_ids),
            "remote_host": config.kv_ip, "remote_port": config.kv_port, "remote_lease_id": "bench-lease"}


def pull_times(producer: EngineCore, puller: KVPuller, params: dict, repeats: int,
               between: Callable[[], None]) -> tuple[list[float], int]:
    """Seconds of each timed pull of the held blocks and the bytes one moves; ``between`` runs after each
    timed pull (the raw-socket copy, so that both see the same machine load)."""
    blocks = params["remote_block_ids"]
    job = PullJob("bench", params["remote_host"], params["remote_port"], params["remote_lease_id"], blocks,
                  params["remote_block_generations"], list(range(len(blocks))))
    poller = zmq.Poller()
    for sock in (producer.kv_connector.server.socket, puller.wake):
        poller.register(sock, zmq.POLLIN)
    seconds, num_bytes = [], 0
    for i in range(repeats + 1):  # NOTE: the first pull also connects and handshakes: not timed
        puller.submit(job)
        results = []
        while not results:
            ready = dict(poller.poll(1000))  # NOTE: as the engine loop does: sleep (GIL released) until a socket wakes
            if producer.kv_connector.server.socket in ready:
                producer.step()
            results = puller.results()
        if results[0].error:
            raise SystemExit(f"pull failed: {results[0].error}")
        if i:
            seconds.append(results[0].seconds)
            num_bytes = results[0].num_bytes
            between()
    return seconds, num_bytes


class RawSocket:
    """One loopback TCP connection and a sender thread, set up once: ``time_copy()`` moves ``num_bytes`` over
    it (``sendall`` from a thread, ``recv_into`` a preallocated, already written buffer), as the KV puller's
    persistent connection and warm cache are: neither side pays a connection or a page fault."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.payload = os.urandom(1 << 20) * (num_bytes >> 20) + os.urandom(num_bytes & ((1 << 20) - 1))
        self.sink = memoryview(bytearray(self.payload))  # NOTE: written once, so its pages are mapped
        self.server = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(self.server.getsockname())
        self.conn, _ = self.server.accept()
        self.go = threading.Semaphore(0)
        self.sender = threading.Thread(target=self._send, daemon=True)
        self.sender.start()

    def _send(self) -> None:
        while True:
            self.go.acquire()
            if self.payload is None:
                return
            self.client.sendall(self.payload)

    def time_copy(self) -> float:
        """Seconds of one copy of ``num_bytes`` (the sender starts when the clock does)."""
        t0 = time.perf_counter()
        self.go.release()
        got = 0
        while got < self.num_bytes:
            n = self.conn.recv_into(self.sink[got:], self.num_bytes - got)
            if n == 0:
                raise SystemExit("raw socket closed early")
            got += n
        return time.perf_counter() - t0

    def close(self) -> None:
        self.payload = None
        self.go.release()
        self.sender.join()
        for sock in (self.conn, self.client, self.server):
            sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--synthetic", action="store_true",
                    help="hold blocks for --prompt-tokens without computing them (no prefill forward pass)")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    add_serving_args(ap)
    args = ap.parse_args()
    result = {"command": " ".join(sys.argv), "loadavg_start": os.getloadavg(),
              "transfer": transfer(args)}
    print(json.dumps(result["transfer"], indent=2), flush=True)
    if not args.no_serving:
        result["serving"] = run_serving(args)
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "transfer"}, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


def transfer(args: argparse.Namespace) -> dict:
    """The KV pull vs the raw socket (part 1 of the module docstring)."""
    model = resolve_model_path(None if args.model == "default" else args.model)
    num_blocks = args.prompt_tokens // 16 + 8
    producer = prefill_engine(model, args.dtype, num_blocks)
    t0 = time.perf_counter()
    params = hold_blocks(producer, args.prompt_tokens) if args.synthetic else prefill(producer, args.prompt_tokens)
    prefill_s = time.perf_counter() - t0
    consumer = EngineCore(model, EngineConfig(model=ModelConfig(model=str(model), dtype=args.dtype),
                                              cache=CacheConfig(num_blocks=num_blocks)), progress=False)
    puller = KVPuller(producer.kv_connector.ctx, kv_identity(consumer.runner), None, consumer.runner.kv_cache_groups,
                      timeout_s=60)
    num_bytes = len(params["remote_block_ids"]) * sum(  # NOTE: K and V of every layer of every held block
        k[0].nbytes + v[0].nbytes for layers in producer.runner.kv_cache_groups() for k, v in layers)
    raw, raw_s = RawSocket(num_bytes), []
    raw.time_copy()  # NOTE: as the first pull, not timed
    try:
        pull_s, pulled = pull_times(producer, puller, params, args.repeats, lambda: raw_s.append(raw.time_copy()))
    finally:
        raw.close()
        puller.close()
        producer.close()
    assert pulled == num_bytes, (pulled, num_bytes)
    pull_gbs = num_bytes / statistics.median(pull_s) / 1e9
    raw_gbs = num_bytes / statistics.median(raw_s) / 1e9
    result = {"model": str(model), "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
              "blocks": len(params["remote_block_ids"]), "bytes": num_bytes, "prefill_s": round(prefill_s, 3),
              "pull_s_median": statistics.median(pull_s), "raw_socket_s_median": statistics.median(raw_s),
              "pull_GBps": round(pull_gbs, 3), "raw_socket_GBps": round(raw_gbs, 3),
              "ratio": round(pull_gbs / raw_gbs, 3), "loadavg": os.getloadavg()}
    del producer, consumer
    return result


if __name__ == "__main__":
    main()
