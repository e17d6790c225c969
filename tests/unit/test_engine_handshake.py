"""The networked engine core's gate, model-free: the HMAC handshake (PeerGate), ParallelConfig's
refusals, the `tandem engine` CLI refusing a non-loopback bind without a secret, and the service and
client over real loopback sockets with a fake engine (no model, no torch)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import types

import pytest

from tandem.cli import main
from tandem.config import ConfigError, ParallelConfig
from tandem.engine.handshake import (
    REFUSED_BUSY,
    REFUSED_SECRET,
    Challenge,
    Hello,
    PeerGate,
    Proof,
    Refused,
    sign,
)

SECRET = b"s3cret-value"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def challenge(gate: PeerGate, identity: bytes) -> bytes:
    reply = gate.on_hello(identity, Hello())
    assert isinstance(reply, Challenge) and reply.auth is (gate.secret is not None) and len(reply.nonce) == 32
    return reply.nonce


def test_the_right_secret_admits_and_a_wrong_or_missing_one_is_refused_and_counted():
    gate = PeerGate(SECRET)
    assert gate.on_proof(b"a", Proof(sign(b"wrong", challenge(gate, b"a")))) == Refused(REFUSED_SECRET)
    assert gate.on_proof(b"b", Proof(b"")) == Refused("no handshake in progress: send Hello first")
    challenge(gate, b"b")
    assert gate.on_proof(b"b", Proof(b"")) == Refused(REFUSED_SECRET)
    assert gate.num_refused == 3 and gate.peer is None
    assert gate.on_proof(b"c", Proof(sign(SECRET, challenge(gate, b"c")))) is None
    assert gate.peer == b"c" and gate.seen(b"c") and not gate.seen(b"a")


def test_a_proof_is_good_for_its_own_nonce_only():
    gate = PeerGate(SECRET)
    old = sign(SECRET, challenge(gate, b"a"))
    challenge(gate, b"a")  # a new Hello: a new nonce replaces the old one
    assert gate.on_proof(b"a", Proof(old)) == Refused(REFUSED_SECRET)
    assert gate.on_proof(b"a", Proof(old)) == Refused("no handshake in progress: send Hello first")


def test_one_front_end_at_a_time_until_it_is_released_or_silent():
    clock = Clock()
    gate = PeerGate(SECRET, clock, peer_timeout_s=5.0)
    assert gate.on_proof(b"a", Proof(sign(SECRET, challenge(gate, b"a")))) is None
    assert gate.on_proof(b"b", Proof(sign(b"wrong", challenge(gate, b"b")))) == Refused(REFUSED_SECRET)
    assert gate.on_proof(b"b", Proof(sign(SECRET, challenge(gate, b"b")))) == Refused(REFUSED_BUSY)
    clock.now += 4.0
    assert gate.seen(b"a") and not gate.expired()
    clock.now += 5.1
    assert gate.expired()
    gate.release()
    assert gate.on_proof(b"b", Proof(sign(SECRET, challenge(gate, b"b")))) is None and gate.peer == b"b"
    assert gate.num_refused == 2


def test_a_gate_without_a_secret_admits_any_proof_and_other_protocols_are_refused():
    gate = PeerGate(None)
    challenge(gate, b"a")
    assert gate.on_proof(b"a", Proof(b"anything"), "127.0.0.1") is None
    assert gate.on_hello(b"z", Hello(protocol=99)) == Refused("protocol 99 is not supported (this core speaks 1)")


def test_a_handshake_left_open_expires():
    clock = Clock()
    gate = PeerGate(SECRET, clock)
    nonce = challenge(gate, b"a")
    clock.now += 11.0
    assert gate.on_proof(b"a", Proof(sign(SECRET, nonce))) == Refused("no handshake in progress: send Hello first")


def test_parallel_config_refuses_an_open_port_without_a_secret(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_ENGINE_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"^refusing to listen on tcp://0\.0\.0\.0:5555 without a shared secret"):
        ParallelConfig(listen_address="tcp://0.0.0.0:5555")
    assert ParallelConfig(listen_address="tcp://127.0.0.1:5555").secret() is None
    assert ParallelConfig(listen_address="tcp://localhost:5555").listen_address == "tcp://localhost:5555"
    secret_file = tmp_path / "secret"
    secret_file.write_text("abc\n")
    assert ParallelConfig(listen_address="tcp://*:5555", engine_secret_file=str(secret_file)).secret() == b"abc"
    monkeypatch.setenv("TANDEM_ENGINE_SECRET", "from-env")
    assert ParallelConfig(listen_address="tcp://10.1.2.3:5555").secret() == b"from-env"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"data_parallel_size": 2, "engine_address": "tcp://127.0.0.1:5555"},
     "engine_address serves one remote engine core; it cannot be combined with data_parallel_size > 1 or the ray "
     "backend"),
    ({"data_parallel_backend": "k8s"}, "data_parallel_backend must be one of ('mp', 'ray'), got 'k8s'"),
    ({"routing_policy": "random"},
     "routing_policy must be one of ('round-robin', 'least-load', 'kv-aware'), got 'random'"),
    ({"ray_address": "auto"}, "ray_address needs data_parallel_backend 'ray'"),
    ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1, got 0"),
    ({"engine_address": "127.0.0.1:5555"}, "an engine address must look like tcp://HOST:PORT, got '127.0.0.1:5555'"),
    ({"engine_address": "tcp://h:0"}, "an engine address must look like tcp://HOST:PORT with a port 1-65535, "
                                      "got 'tcp://h:0'"),
    ({"engine_secret_file": "/nonexistent/secret"},
     "cannot read the engine secret file /nonexistent/secret: No such file or directory"),
])
def test_parallel_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert str(info.value) == message


def test_an_empty_secret_file_is_refused(tmp_path):
    (tmp_path / "s").write_text(" \n")
    with pytest.raises(ConfigError, match="is empty$"):
        ParallelConfig(engine_secret_file=str(tmp_path / "s"))


def test_tandem_engine_refuses_a_non_loopback_bind_without_a_secret(monkeypatch, capsys):
    monkeypatch.delenv("TANDEM_ENGINE_SECRET", raising=False)
    assert main(["engine", "--model", "/nonexistent", "--listen", "tcp://0.0.0.0:5555"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: refusing to listen on tcp://0.0.0.0:5555 without a shared secret")
    assert len(err.splitlines()) == 1


def test_serve_refuses_data_parallel_with_an_engine_address(capsys):
    assert main(["serve", "--model", "/nonexistent", "--engine-address", "tcp://127.0.0.1:5555", "-dp", "2"]) == 2
    assert capsys.readouterr().err.startswith("tandem: error: engine_address serves one remote engine core; ")


# ---- the service and the client over loopback sockets, with a fake engine ----
class FakeCore:
    """Enough of EngineCore for the service loop: it queues requests and never runs them."""

    max_model_len = 64

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return False

    def on_idle(self) -> None:
        pass

    def stats(self) -> object:
        return type("Stats", (), {"num_waiting": len(self.added) - len(self.aborted)})()

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, ids) -> None:
        self.aborted.extend(ids)


@pytest.fixture
def service():
    """A running EngineCoreService (fake engine) on a free loopback port; yields (service, address)."""
    import zmq

    from tandem.engine.core_proc import Ready
    from tandem.engine.core_service import EngineCoreService, bind_router

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = zmq.Context()
    sock = bind_router(ctx, address)
    svc = EngineCoreService(FakeCore(), sock, PeerGate(SECRET), Ready(64, 10, 16, "fake", 512), 0)
    thread = threading.Thread(target=svc.run, daemon=True)
    thread.start()
    svc.router, svc.thread = sock, thread  # NOTE: for a test that closes the core's end itself
    yield svc, address
    svc.stopping = True
    thread.join(5)
    sock.close(linger=0)
    ctx.term()


def test_client_and_service_handshake_over_tcp(service):
    from tandem.engine.remote_client import EngineRefusedError, RemoteEngineCoreClient

    svc, address = service
    with pytest.raises(EngineRefusedError) as info:
        RemoteEngineCoreClient.connect(address, b"wrong", timeout_s=5)
    assert str(info.value) == f"the engine core at {address} refused this front end: {REFUSED_SECRET}"
    with pytest.raises(EngineRefusedError, match=REFUSED_SECRET):
        RemoteEngineCoreClient.connect(address, None, timeout_s=5)
    client = RemoteEngineCoreClient.connect(address, SECRET, timeout_s=5)
    try:
        assert (client.max_model_len, client.num_blocks, client.block_size, client.model, client.vocab_size) == \
            (64, 10, 16, "fake", 512)
        assert client.pid is None and client.is_alive()
        with pytest.raises(EngineRefusedError, match="already serves another front end"):
            RemoteEngineCoreClient.connect(address, SECRET, timeout_s=5)
        assert svc.gate.num_refused == 3
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while svc.gate.peer is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.gate.peer is None  # its Goodbye freed the core for the next front end
    RemoteEngineCoreClient.connect(address, SECRET, timeout_s=5).close()


def test_an_unauthenticated_add_never_reaches_the_engine(service):
    import msgspec
    import zmq

    from tandem.engine.core_proc import AddRequests, WireRequest
    from tandem.sampling_params import SamplingParams

    svc, address = service
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        wire = WireRequest("r1", [1, 2], SamplingParams(max_tokens=2), [], 2, 0.0)
        sock.send(msgspec.msgpack.encode(AddRequests("r1", [wire])))
        assert sock.poll(5000)
        reply = msgspec.msgpack.decode(sock.recv(), type=Refused)
        assert reply == Refused("not authenticated: send Hello and a Proof first")
        sock.send(b"\xc1garbage")
        assert sock.poll(5000)
        assert msgspec.msgpack.decode(sock.recv(), type=Refused).reason.startswith("malformed message")
    finally:
        sock.close(linger=0)
        ctx.term()
    assert svc.core.added == [] and svc.gate.num_refused == 2


def test_a_silent_core_is_declared_lost_by_the_heartbeat_timeout(service):
    from tandem.engine.remote_client import RemoteEngineCoreClient

    svc, address = service
    client = RemoteEngineCoreClient.connect(address, SECRET, timeout_s=5, heartbeat_timeout_s=1.5)

    async def run() -> str:
        lost = asyncio.get_running_loop().create_future()
        client.attach(lambda: lost.set_result(client.loss_reason))
        svc.stopping = True  # NOTE: the loop ends, the socket stays open: a hung core, not a closed one
        try:
            return await asyncio.wait_for(lost, 10)
        finally:
            client.detach()

    try:
        assert asyncio.run(run()) == f"the engine core at {address} sent nothing for 1.5 s"
        assert not client.is_alive()
    finally:
        client.close()


def test_a_send_on_a_connection_that_just_dropped_is_the_cores_loss_not_a_full_queue(service):
    """The core's process is gone (its socket closed) and a request arrives before the watchdog's turn: ZeroMQ
    refuses the send as it refuses one on a full queue, but the answer is 503 engine_unavailable, not 429."""
    import zmq

    from tandem.engine.remote_client import RemoteEngineCoreClient
    from tandem.errors import EngineDeadError
    from tandem.sampling_params import SamplingParams

    svc, address = service
    client = RemoteEngineCoreClient.connect(address, SECRET, timeout_s=5)
    request = types.SimpleNamespace(request_id="r1-0", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                                    eos_token_ids={0}, max_tokens=2, arrival_time=0.0)
    deaths = []

    async def run() -> BaseException:
        client.attach(lambda: deaths.append(client.loss_reason))
        svc.stopping = True
        svc.thread.join(5)
        svc.router.close(linger=0)  # NOTE: the core's end closes, as when its process is killed
        deadline = time.monotonic() + 5  # NOTE: blocking: the watchdog gets no turn meanwhile
        # NOTE: the monitor's event first, then the pipe's end reaches the socket (no room to send: the 429 before)
        while not client._monitor.get(zmq.EVENTS) & zmq.POLLIN or client.inputs.poll(0, zmq.POLLOUT):
            assert time.monotonic() < deadline, "ZeroMQ did not notice the closed connection within 5 s"
            time.sleep(0.01)
        try:
            client.add_requests("r1", [request])
        except Exception as e:  # noqa: BLE001 - the test checks which
            error = e
        for _ in range(50):  # the watchdog's turn: on_death once
            if deaths:
                break
            await asyncio.sleep(0.1)
        client.detach()
        return error

    try:
        error = asyncio.run(run())
    finally:
        client.close()
    assert isinstance(error, EngineDeadError), repr(error)
    assert str(error) == f"the connection to the engine core at {address} was lost; reconnecting"
    assert error.retry_after == 2.0
    assert deaths == [f"the connection to the engine core at {address} was lost"]


def test_a_message_that_arrives_while_a_send_runs_is_still_read(service):
    """The core's messages and the front end's sends share one DEALER socket: a send (a heartbeat, a request) made
    after a message arrived but before the loop's turn takes ZeroMQ's wake-up for it, and a reader that waited
    only for that wake-up saw nothing more (the first request after a Ray rejoin hung until the 30 s heartbeat
    timeout). The reader looks again at least every RECV_RECHECK_S."""
    import zmq

    from tandem.engine.core_proc import AddResult
    from tandem.engine.remote_client import RemoteEngineCoreClient

    svc, address = service
    client = RemoteEngineCoreClient.connect(address, SECRET, timeout_s=5)
    peer = svc.gate.peer

    async def run() -> object:
        client.attach(lambda: None)
        reading = asyncio.get_running_loop().create_task(client.get_output())
        await asyncio.sleep(0.2)  # NOTE: the reader waits for ZeroMQ's wake-up now
        svc.stopping = True
        svc.thread.join(5)  # NOTE: the core's loop ends; its socket stays open and sends from here
        svc.router.send_multipart([peer, svc.encoder.encode(AddResult("r1", 200))])
        deadline = time.monotonic() + 5  # NOTE: blocking: the loop gets no turn meanwhile
        while not client.inputs.get(zmq.EVENTS) & zmq.POLLIN:  # the message is there; this took the wake-up
            assert time.monotonic() < deadline, "the message did not arrive within 5 s"
            time.sleep(0.01)
        client._send_heartbeat()
        try:
            return await asyncio.wait_for(reading, 5)
        finally:
            client.detach()

    try:
        assert asyncio.run(run()) == AddResult("r1", 200)
    finally:
        client.close()
