"""``--kv-transfer-config`` mistakes found before the model loads (no model): mistyped values, an empty or
unreadable secret, a KV port another process holds."""

from __future__ import annotations

import socket

import pytest

from tandem.config import ConfigError, KVTransferConfig
from tandem.server.cli import kv_ports_error


@pytest.mark.parametrize(("text", "message"), [
    ('{"kv_role": "kv_producer", "lease_ttl_s": true}', "lease_ttl_s must be a finite number > 0, got True"),
    ('{"kv_role": "kv_consumer", "transfer_timeout_s": false}', "transfer_timeout_s must be a finite number > 0"),
    ('{"kv_role": "kv_producer", "engine_id": 5}', "engine_id must be a string, got 5"),
    ('{"kv_role": "kv_producer", "secret": 5}', "secret must be a string, got 5"),
    ('{"kv_role": "kv_producer", "secret_file": [1]}', r"secret_file must be a string, got \[1\]"),
    ('{"kv_role": "kv_producer", "kv_ip": 5}', "kv_ip must be a string, got 5"),
    ('{"kv_role": "kv_producer", "secret": " "}', "secret must not be empty"),
    ('{"kv_role": "kv_consumer", "secret_file": "/nonexistent/kv.secret"}',
     "cannot read the KV secret file /nonexistent/kv.secret: No such file or directory"),
])
def test_mistakes_are_config_errors_before_the_model_loads(text, message):
    """These were accepted (a bool as a lease time, an int engine id) or failed in the engine core after the
    weights had loaded (an AttributeError for an int secret; the empty or missing secret)."""
    with pytest.raises(ConfigError, match=message):
        KVTransferConfig.from_json(text)


def test_a_kv_port_in_use_is_named_before_the_model_loads():
    """It failed after the model loaded, in the engine core, with a ZeroMQ traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        producer = KVTransferConfig(kv_role="kv_producer", kv_port=port)
        assert kv_ports_error(producer) == (f"cannot bind the KV transfer port 127.0.0.1:{port} (--kv-transfer-config "
                                            f"kv_port): Address already in use")
        data = KVTransferConfig(kv_role="kv_producer", kv_port=free_port(), kv_data_port=port)
        assert "(--kv-transfer-config kv_data_port): Address already in use" in kv_ports_error(data)
        assert kv_ports_error(KVTransferConfig(kv_role="kv_consumer", kv_port=port)) is None  # binds nothing
    assert kv_ports_error(KVTransferConfig(kv_role="kv_producer", kv_port=port)) is None
    assert kv_ports_error(None) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
