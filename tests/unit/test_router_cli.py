"""`tandem router` flags: bad settings fail at start with a clear message (exit 2), before serving."""

import pytest

from tandem.cli import main
from tandem.config import ConfigError
from tandem.router.config import RouterConfig


@pytest.mark.parametrize(("argv", "message"), [
    (["router"], "the router needs at least one --backend URL"),
    (["router", "--backend", "localhost:8000"], "a backend must be an http(s) URL like http://127.0.0.1:8000, "
                                                "got 'localhost:8000'"),
    (["router", "--backend", "http://a:1", "--backend", "http://a:1/"], "a backend is listed twice"),
    (["router", "--backend", "http://a:1", "--kv-events", "http://b:1=tcp://b:5557"],
     "--kv-events names http://b:1, which is not a --backend"),
    (["router", "--backend", "http://a:1", "--max-outstanding-per-backend", "0"],
     "max_outstanding_per_backend must be >= 1, got 0"),
    # nothing listens on port 1: no /v1/models names a tokenizer, and kv-aware needs one
    (["router", "--backend", "http://127.0.0.1:1", "--connect-timeout", "0.5"],
     "the kv-aware policy needs the backends' tokenizer: pass --tokenizer PATH"),
])
def test_bad_router_settings_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_kv_events_flag_needs_url_and_endpoint(capsys):
    with pytest.raises(SystemExit) as e:
        main(["router", "--backend", "http://a:1", "--kv-events", "tcp://a:5557"])
    assert e.value.code == 2 and "expected URL=ENDPOINT" in capsys.readouterr().err


def test_config_normalises_urls_and_checks_endpoints():
    c = RouterConfig(backends=("http://a:1/",), kv_events=(("http://a:1", "tcp://a:5557"),))
    assert c.backends == ("http://a:1",) and c.kv_events == (("http://a:1", "tcp://a:5557"),)
    with pytest.raises(ConfigError, match="must be a ZeroMQ address"):
        RouterConfig(backends=("http://a:1",), kv_events=(("http://a:1", "a:5557"),))
    with pytest.raises(ConfigError, match="unknown routing policy 'fastest'"):
        RouterConfig(backends=("http://a:1",), policy="fastest")
