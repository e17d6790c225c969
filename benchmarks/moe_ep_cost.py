"""What expert parallelism would cost and save on CPUs: one MoE layer's time vs an all-to-all over TCP.

Usage:
    python benchmarks/moe_ep_cost.py [--experts 128] [--top-k 8] [--hidden 2048] [--inter 768] [--repeats 20]

Measures, side by side in one run (docs/expert_parallelism.md reads these numbers):
  - ``kernels.moe_bf16`` on one layer of the given shape (default: Qwen3-30B-A3B's) at 1 and 16 tokens,
    with all experts local, and with half of them (what each of two expert-parallel nodes runs: it keeps
    the assignments routed to its own experts, about half of them);
  - the round trip of one layer's activations over ZeroMQ on TCP loopback (``T x hidden`` bf16 there
    and back, the dispatch + combine of one all-to-all between two nodes), median of ``--repeats``.
Random weights and uniform random routing. Prints a Markdown table and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
import zmq

from tandem import kernels


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def moe_seconds(experts: int, top_k: int, hidden: int, inter: int, tokens: int, local: int, repeats: int) -> float:
    """Median seconds of one ``moe_bf16`` call where only ``local`` of the ``experts`` live here."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(local, 2 * inter, hidden, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(local, hidden, inter, generator=g) * 0.02).bfloat16()
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    # NOTE: a node keeps the assignments to its own experts; the other slots of a token repeat its first
    # local expert with weight 0, so the call keeps its [T, k] shape without reading another expert.
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    mine = ids < local
    first = torch.where(mine.any(1), ids.masked_fill(~mine, local).min(1).values, torch.zeros(tokens, dtype=ids.dtype))
    weights = torch.where(mine, weights, torch.zeros_like(weights))
    ids = torch.where(mine, ids, first[:, None].expand_as(ids))
    return _time(lambda: kernels.moe_bf16(x, w13, w2, weights, ids), repeats)


def round_trip_seconds(nbytes: int, repeats: int) -> float:
    """Median seconds to send ``nbytes`` to a peer over TCP loopback and get ``nbytes`` back."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.PAIR)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.PAIR)
    client.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if server.poll(50):
                server.send(server.recv(copy=False), copy=False)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    payload = os.urandom(nbytes)

    def once() -> None:
        client.send(payload, copy=False)
        client.recv(copy=False)

    try:
        return _time(once, repeats)
    finally:
        stop.set()
        thread.join()
        client.close(0)
        server.close(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    load = os.getloadavg()[0]
    print(f"threads={torch.get_num_threads()} shape E={args.experts} k={args.top_k} H={args.hidden} I={args.inter}")
    print("| tokens | MoE layer, all experts (ms) | MoE layer, half the experts (ms) | all-to-all round trip (ms) |")
    print("|---|---|---|---|")
    for tokens in (1, 16):
        full = moe_seconds(args.experts, args.top_k, args.hidden, args.inter, tokens, args.experts, args.repeats)
        half = moe_seconds(args.experts, args.top_k, args.hidden, args.inter, tokens, args.experts // 2, args.repeats)
        rtt = round_trip_seconds(tokens * args.hidden * 2, args.repeats * 10)
        print(f"| {tokens} | {full * 1e3:.2f} | {half * 1e3:.2f} | {rtt * 1e3:.3f} |")
    print(f"load average (1 min): {load:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
