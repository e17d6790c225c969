"""Model-free checks of the decode side's producer allowlist (``disagg/peers.py``, ``prefill_hosts``) and of
the refusal count: one refused decode leg is one refused handshake on the producer, whether its pull
ran at once or a lease renewal reached the producer first (real loopback sockets, no model)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from tandem.config import ConfigError, KVTransferConfig
from tandem.disagg.connector import RemotePrefill
from tandem.disagg.consumer import KVPuller, PullJob
from tandem.disagg.messages import KVIdentity
from tandem.disagg.producer import KVTransferServer


def test_default_allowlist_is_loopback_and_own_kv_ip():
    peers = KVTransferConfig(kv_role="kv_consumer").prefill_peers()
    assert peers.allows("127.0.0.1", 14579) and peers.allows("127.3.4.5", 1) and peers.allows("::1", 9)
    assert peers.allows("localhost", 80) and peers.allows("[::1]", 80)
    for host in ("169.254.169.254", "10.0.0.5", "0.0.0.0", "metadata.google.internal", "127.0.0.1.nip.io"):
        assert not peers.allows(host, 14579), host
    assert peers.refusal("169.254.169.254", 80) == (
        "kv_transfer_params.remote_host '169.254.169.254' (port 80) is not an allowed prefill engine; this decode "
        "engine pulls KV only from loopback (the default): add it to \"prefill_hosts\" in --kv-transfer-config")
    both = KVTransferConfig(kv_role="kv_both", kv_ip="10.0.0.7", secret="s").prefill_peers()
    assert both.allows("10.0.0.7", 1) and not both.allows("10.0.0.8", 1)


def test_explicit_prefill_hosts_replace_the_default():
    config = KVTransferConfig.from_json('{"kv_role": "kv_consumer", "prefill_hosts": '
                                        '["10.0.1.0/24", "prefill-a:14579", "[fd00::1]:7000", "10.0.0.9"]}')
    assert config.prefill_hosts == ("10.0.1.0/24", "prefill-a:14579", "[fd00::1]:7000", "10.0.0.9")
    peers = config.prefill_peers()
    assert peers.allows("10.0.1.200", 5) and peers.allows("10.0.0.9", 5)
    assert peers.allows("PREFILL-A", 14579) and not peers.allows("prefill-a", 14580)
    assert peers.allows("fd00::1", 7000) and not peers.allows("fd00::1", 7001)
    assert not peers.allows("127.0.0.1", 14579)  # NOTE: an explicit list is the whole list
    assert "10.0.1.0/24, prefill-a:14579" in peers.refusal("10.0.2.1", 5)


@pytest.mark.parametrize(("value", "message"), [
    ("10.0.0.1", "must be a list"),
    (["10.0.0.1:99999"], "the port must be 1-65535"),
    (["300.1.2.3"], "is not an IP address"),
    ([""], "must not be empty"),
    (["[::1"], "is not an IP address"),
    ([7], "must be a list"),
])
def test_bad_prefill_hosts_are_config_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        KVTransferConfig(kv_role="kv_consumer", prefill_hosts=value)


LEG = {"remote_host": "127.0.0.1", "remote_port": 14579, "remote_lease_id": "kv-1", "remote_block_ids": [3],
       "remote_block_generations": [1]}


@pytest.mark.parametrize(("changes", "message"), [
    ({"remote_port": 0}, "kv_transfer_params.remote_port must be 1-65535, got 0"),
    ({"remote_port": 99999}, "kv_transfer_params.remote_port must be 1-65535, got 99999"),
    ({"remote_port": -5}, "kv_transfer_params.remote_port must be 1-65535, got -5"),
    ({"remote_port": "14579"}, "kv_transfer_params.remote_port must be an integer (from the prefill leg's response), "
                               "got '14579'"),
    ({"remote_host": 5}, "kv_transfer_params.remote_host must be a string (from the prefill leg's response), got 5"),
])
def test_a_decode_legs_bad_remote_port_is_a_400_before_any_connection(changes, message):
    """Ports outside 1-65535 were accepted: the puller then waited transfer_timeout_s (or zmq refused the
    address) before the fallback, holding up every pull queued behind it."""
    with pytest.raises(ValueError) as e:
        RemotePrefill.parse({**LEG, **changes})
    assert str(e.value) == message


def test_a_bracketed_ipv6_remote_host_is_the_address():
    """"[::1]" passed the allowlist but the puller connected to tcp://[[::1]]:port (never answered)."""
    assert RemotePrefill.parse({**LEG, "remote_host": "[::1]"}).host == "::1"


IDENTITY = KVIdentity("a" * 64, "float32", 4, [(2, 1, 8)])


@pytest.fixture
def producer():
    ctx = zmq.Context.instance()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = KVTransferServer(ctx, "127.0.0.1", port, IDENTITY, None, "p", kv_manager=None,
                              kv_cache_groups=lambda: [])
    stop = threading.Event()

    def serve() -> None:  # NOTE: as the engine thread does between steps
        while not stop.is_set():
            server.serve_pending()
            server.socket.poll(5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server, port
    stop.set()
    thread.join(5)
    server.close()


@pytest.mark.parametrize("renew_first", [False, True])
def test_a_refused_decode_engine_is_counted_once(producer, renew_first):
    server, port = producer
    other = KVIdentity("b" * 64, "float32", 8, [(2, 1, 8)])  # another model and block size
    puller = KVPuller(zmq.Context.instance(), other, None, lambda: [], timeout_s=2.0)
    try:
        if renew_first:  # a decode leg that waited for free blocks renewed its lease before pulling
            puller.renew("127.0.0.1", port, ["lease-1"])
        puller.submit(PullJob("r1", "127.0.0.1", port, "lease-1", [0], [0], [0]))
        deadline, results = time.monotonic() + 10, []
        while not results and time.monotonic() < deadline:
            puller.wake.poll(50)
            results = puller.results()
        assert len(results) == 1 and "refused this decode engine" in results[0].error
        assert "block size 4 != 8" in results[0].error and "model (hash of config + weight names" in results[0].error
        assert server.num_refused == 1
    finally:
        puller.close()
