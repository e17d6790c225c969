"""Model-free checks of the KV data channel (``disagg/data_channel.py``): a pull's bytes land in the right
local blocks whether the ids on either side are runs (sent and received in place) or scattered (gathered
on the producer, staged on the decode side); a data connection without the handshake's token is refused
and counted; a reply that outlives its lease is cut off and never taken as complete (real loopback sockets)."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from tandem.disagg import consumer as consumer_module
from tandem.disagg.consumer import KVPuller, PullJob
from tandem.disagg.messages import KVIdentity
from tandem.disagg.producer import KVTransferServer

IDENTITY = KVIdentity("a" * 64, "bfloat16", 4, [(3, 2, 8), (1, 2, 8)])  # target 3 layers, draft 1
NUM_BLOCKS = 40


class Leases:
    """The slice of ``KVCacheManager`` the KV server uses: one lease over all blocks, generation 0."""

    def __init__(self, ttl_s: float) -> None:
        self.leases = SimpleNamespace(ttl_s=ttl_s)

    def held_block_ids(self, lease_id: str) -> list[int]:
        return list(range(NUM_BLOCKS))

    def block_generations(self, block_ids: list[int]) -> list[int]:
        return [0] * len(block_ids)

    def renew(self, lease_id: str) -> None:
        pass


def caches(seed: int | None) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Target and draft caches ``[NUM_BLOCKS, 4, 2, 8]`` bf16: random (``seed``) or zeros (None)."""
    gen = torch.Generator().manual_seed(seed or 0)

    def one() -> torch.Tensor:
        x = torch.randn(NUM_BLOCKS, 4, 2, 8, generator=gen).to(torch.bfloat16)
        return x if seed is not None else torch.zeros_like(x)

    return [[(one(), one()) for _ in range(layers)] for layers, _, _ in IDENTITY.caches]


@pytest.fixture
def pair(request):
    ttl_s = getattr(request, "param", 30.0)
    ctx = zmq.Context.instance()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source, dest = caches(seed=1), caches(seed=None)
    server = KVTransferServer(ctx, "127.0.0.1", port, IDENTITY, None, "p", Leases(ttl_s), lambda: source)
    puller = KVPuller(ctx, IDENTITY, None, lambda: dest, timeout_s=5.0)
    stop = threading.Event()

    def serve() -> None:  # NOTE: as the engine thread does between steps
        while not stop.is_set():
            server.serve_pending()
            server.socket.poll(5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server, puller, port, source, dest
    stop.set()
    thread.join(5)
    puller.close()
    server.close()


def pull(puller: KVPuller, port: int, remote: list[int], local: list[int]) -> object:
    puller.submit(PullJob("r", "127.0.0.1", port, "lease", remote, [0] * len(remote), local))
    deadline, results = time.monotonic() + 10, []
    while not results and time.monotonic() < deadline:
        puller.wake.poll(50)
        results = puller.results()
    assert len(results) == 1
    return results[0]


@pytest.mark.parametrize(("remote", "local"), [
    (list(range(3, 15)), list(range(20, 32))),  # runs on both sides: sent and received in place
    ([7, 2, 30, 11, 0, 5, 19, 3, 25, 14, 9, 1], [21, 4, 33, 8, 16, 0, 38, 12, 27, 2, 35, 10]),  # 12 runs: staged
    (list(range(12)), [39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17]),  # sent in place, staged on arrival
    ([30, 1, 22, 9], [16, 17, 18, 19]),  # gathered by the producer, received in place
])
def test_pulled_bytes_land_in_the_named_local_blocks(pair, remote, local):
    _, puller, port, source, dest = pair
    result = pull(puller, port, remote, local)
    assert result.error is None
    assert result.num_bytes == len(remote) * 4 * 2 * 8 * 2 * 2 * 4  # tokens x heads x dim x bf16 x (K, V) x layers
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
    for src_layers, dst_layers in zip(source, dest, strict=True):
        for (sk, sv), (dk, dv) in zip(src_layers, dst_layers, strict=True):
            assert torch.equal(dk[local], sk[remote]) and torch.equal(dv[local], sv[remote])
            assert not dk[untouched].any() and not dv[untouched].any()


def test_a_data_connection_without_the_token_is_refused_and_counted(pair):
    server, puller, port, _, _ = pair
    with socket.create_connection(("127.0.0.1", server.data.port), timeout=5) as rogue:
        rogue.sendall(b"x" * 32)
        rogue.settimeout(5)
        assert rogue.recv(1) == b""  # closed, nothing sent
    assert server.num_refused == 1
    assert pull(puller, port, [1, 2], [3, 4]).error is None  # the real peer is unaffected


@pytest.mark.parametrize("pair", [1e-6], indirect=True)
def test_a_reply_that_outlives_its_lease_is_cut_off(pair):
    _, puller, port, _, dest = pair
    result = pull(puller, port, [1, 2, 3], [4, 5, 6])
    assert result.error.startswith("the prefill engine closed the KV data connection after 0 of 384 bytes")
    assert not puller._peers and not puller._data  # both connections dropped; the next pull handshakes again


def test_runs():
    assert consumer_module._runs([4, 5, 6, 9, 2, 3]) == [(4, 3), (9, 1), (2, 2)]


def test_a_producer_that_goes_silent_mid_stream_fails_the_pull_at_the_timeout(pair):
    server, puller, port, _, _ = pair
    puller.timeout_ms = 300  # NOTE: before the first pull opens the data connection
    send, stall = server.data._send_frame, threading.Event()

    def stalling_send(sock, frame, staging):
        if stall.is_set():
            time.sleep(2)  # NOTE: alive but silent (a frozen process keeps its connections open)
        stall.set()
        return send(sock, frame, staging)

    server.data._send_frame = stalling_send
    t0 = time.monotonic()
    result = pull(puller, port, [1, 2, 3], [4, 5, 6])
    assert result.error == "the prefill engine sent nothing for 0.3 s (KV blocks)"
    assert time.monotonic() - t0 < 1.9


def test_a_silent_producer_holds_up_only_its_own_pulls(pair):
    """A decode leg may name an allowed address where nothing speaks the protocol (an HTTP port): its
    handshake waits out the timeout (5 s here), and another producer's pull must not queue behind it."""
    _, puller, port, source, dest = pair
    with socket.create_server(("127.0.0.1", 0)) as silent:  # NOTE: accepts TCP (the kernel's backlog), never answers
        silent_port = silent.getsockname()[1]
        puller.submit(PullJob("stuck", "127.0.0.1", silent_port, "lease", [0], [0], [0]))
        time.sleep(0.2)  # NOTE: the silent producer's thread is now inside its handshake
        t0 = time.monotonic()
        result = pull(puller, port, [3, 4], [5, 6])
        assert result.request_id == "r" and result.error is None
        assert time.monotonic() - t0 < 2.5  # NOTE: one thread for all: it came after the 5 s handshake wait
        assert torch.equal(dest[0][0][0][[5, 6]], source[0][0][0][[3, 4]])
        deadline, stuck = time.monotonic() + 10, []
        while not stuck and time.monotonic() < deadline:
            puller.wake.poll(50)
            stuck = puller.results()
        assert [r.request_id for r in stuck] == ["stuck"] and "sent nothing for 5 s" in stuck[0].error
