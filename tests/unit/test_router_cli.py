"""`tandem router` flags: bad settings fail at start with a clear message (exit 2), before serving."""

import pytest

from tandem.cli import main
from tandem.config import ConfigError
from tandem.router.config import RouterConfig

NO_WAIT = ("--backend", "http://a:1", "--backend-startup-timeout", "0")  # a failure cannot start a server


@pytest.mark.parametrize(("argv", "message"), [
    (["router"], "the router needs at least one --backend URL"),
    (["router", "--backend", "localhost:8000"], "a backend must be an http(s) URL like http://127.0.0.1:8000, "
                                                "got 'localhost:8000'"),
    (["router", "--backend", "http://a:1", "--backend", "http://a:1/"], "a backend is listed twice"),
    (["router", "--backend", "http://a:1", "--kv-events", "http://b:1=tcp://b:5557"],
     "--kv-events names http://b:1, which is not a --backend"),
    (["router", "--backend", "http://a:1", "--max-outstanding-per-backend", "0"],
     "max_outstanding_per_backend must be >= 1, got 0"),
    (["router", *NO_WAIT, "--kv-beta", "nan"], "--kv-beta must be a finite number >= 0, got nan"),
    (["router", *NO_WAIT, "--kv-min-match", "1.5"], "--kv-min-match must be in 0-1, got 1.5"),
    (["router", *NO_WAIT, "--kv-min-match", "nan"], "--kv-min-match must be in 0-1, got nan"),
    (["router", *NO_WAIT, "--health-interval", "inf"], "health_interval_s must be a finite number > 0, got inf"),
    (["router", *NO_WAIT, "--eject-seconds", "1", "--max-eject-seconds", "inf"],
     "max_eject_s must be a finite number > 0, got inf"),
    (["router", *NO_WAIT, "--port", "99999"], "--port must be in 0-65535, got 99999"),
    (["router", *NO_WAIT, "--first-byte-timeout", "-1"], "--first-byte-timeout must be a finite number >= 0, got -1.0"),
    # a bad tokenizer or chat template: one line before the server starts, not a failed lifespan
    (["router", *NO_WAIT, "--tokenizer", "/nonexistent/tok"], "cannot load the tokenizer"),
    (["router", "--backend", "http://a:1", "--policy", "round-robin", "--chat-template", "/nonexistent.jinja"],
     "--chat-template '/nonexistent.jinja' is neither an existing file nor a Jinja template"),
    # nothing listens on port 1: no /v1/models names a tokenizer, and kv-aware needs one
    (["router", "--backend", "http://127.0.0.1:1", "--connect-timeout", "0.5", "--backend-startup-timeout", "0"],
     "the kv-aware policy needs the backends' tokenizer: pass --tokenizer PATH (no backend answered GET "
     "/v1/models within 0 s)"),
])
def test_bad_router_settings_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_kv_aware_waits_for_a_loading_backend_to_name_its_tokenizer(tmp_path, capsys):
    """Started before its backend answers, the router waits (saying so once) and finds the tokenizer."""
    import http.server
    import json
    import socket
    import threading
    import time

    from tandem.router.app import with_default_tokenizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"object": "list", "data": [{"id": "m", "root": str(tmp_path)}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = []

    def serve():  # binds only now: until then, connections are refused
        servers.append(http.server.HTTPServer(("127.0.0.1", port), Models))
        servers[0].serve_forever()

    starter = threading.Timer(1.5, serve)  # the backend "finishes loading" after 1.5 s
    starter.start()
    try:
        config = with_default_tokenizer(RouterConfig(backends=(f"http://127.0.0.1:{port}",),
                                                     backend_startup_timeout_s=60.0))
    finally:
        starter.cancel()
        while starter.is_alive() and not servers:
            time.sleep(0.05)
        if servers:
            servers[0].shutdown()
            servers[0].server_close()
        starter.join()
    assert config.tokenizer == str(tmp_path)
    assert capsys.readouterr().err.count("tandem router: waiting up to 60 s for a backend") == 1
    # and gives up at the deadline
    with pytest.raises(ConfigError, match=r"needs the backends' tokenizer.*\(no backend answered GET /v1/models "
                                          r"within 1 s\)"):
        with_default_tokenizer(RouterConfig(backends=(f"http://127.0.0.1:{port}",), backend_startup_timeout_s=1.0))
    with pytest.raises(ConfigError, match="--backend-startup-timeout must be a finite number >= 0"):
        RouterConfig(backends=("http://a:1",), backend_startup_timeout_s=-1)


def test_a_backend_naming_no_local_folder_is_named_at_once(monkeypatch):
    import tandem.router.app as app

    asked = []

    def models_root(url, timeout_s):
        asked.append(url)
        return True, "Qwen/Qwen2.5-0.5B"  # a vLLM backend serving a hub name

    monkeypatch.setattr(app, "_models_root", models_root)
    with pytest.raises(ConfigError) as e:
        app.with_default_tokenizer(RouterConfig(backends=("http://a:1", "http://b:1"), backend_startup_timeout_s=60))
    assert str(e.value) == ("the kv-aware policy needs the backends' tokenizer: pass --tokenizer PATH "
                            "(http://a:1/v1/models names no local folder (its model root: 'Qwen/Qwen2.5-0.5B'))")
    assert asked == ["http://a:1"]  # no waiting: the backend answered


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


def test_first_byte_timeout_flag_maps_onto_the_config_and_zero_turns_it_off():
    import argparse

    from tandem.router.cli import add_router_parser, router_config_from_args

    parser = argparse.ArgumentParser()
    router = add_router_parser(parser.add_subparsers())
    parse = parser.parse_args
    assert router_config_from_args(parse(["router", "--backend", "http://a:1"])).first_byte_timeout_s == 0.0
    config = router_config_from_args(parse(["router", "--backend", "http://a:1", "--first-byte-timeout", "1.5"]))
    assert config.first_byte_timeout_s == 1.5
    assert RouterConfig(backends=("http://a:1",), first_byte_timeout_s=0.0).first_byte_timeout_s == 0.0
    text = " ".join(router.format_help().split())
    assert "--first-byte-timeout SECONDS" in text and "is retried once on another healthy backend" in text


def test_kv_flags_apply_to_kv_aware_and_are_ignored_with_a_warning_otherwise(capsys):
    import argparse

    from tandem.router.cli import add_router_parser, router_config_from_args
    from tandem.router.policy import DEFAULT_BETA, DEFAULT_MIN_MATCH

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    parse = parser.parse_args
    config = router_config_from_args(parse(["router", "--backend", "http://a:1", "--kv-min-match", "0.5"]))
    assert (config.policy, config.beta, config.min_match) == ("kv-aware", DEFAULT_BETA, 0.5)
    assert capsys.readouterr().err == ""
    config = router_config_from_args(parse(["router", "--backend", "http://a:1", "--policy", "round-robin",
                                            "--kv-min-match", "0.5", "--kv-beta", "2"]))
    assert (config.beta, config.min_match) == (2.0, 0.5)  # checked all the same; round-robin reads neither
    assert capsys.readouterr().err == ("tandem router: warning: --kv-beta and --kv-min-match only apply to "
                                       "--policy kv-aware; ignored with --policy round-robin\n")
    config = router_config_from_args(parse(["router", "--backend", "http://a:1", "--policy", "least-load"]))
    assert (config.beta, config.min_match) == (DEFAULT_BETA, DEFAULT_MIN_MATCH) and capsys.readouterr().err == ""
    router_config_from_args(parse(["router", "--backend", "http://a:1", "--policy", "least-load", "--kv-beta", "1"]))
    assert capsys.readouterr().err == ("tandem router: warning: --kv-beta only applies to --policy kv-aware; "
                                       "ignored with --policy least-load\n")
    with pytest.raises(ConfigError, match="--kv-min-match must be in 0-1, got -1.0"):
        router_config_from_args(parse(["router", "--backend", "http://a:1", "--kv-min-match", "-1"]))
    with pytest.raises(ConfigError, match="--kv-min-match must be in 0-1, got 2.0"):  # checked before the warning
        router_config_from_args(parse(["router", "--backend", "http://a:1", "--policy", "round-robin",
                                       "--kv-min-match", "2"]))
    assert capsys.readouterr().err == ""
