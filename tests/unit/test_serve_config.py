"""The CLI and ServerConfig without a model: flags map one to one onto frozen configs, the port
check holds the port, ``--log-level`` after the subcommand, and ``tandem chat``'s commands."""

from __future__ import annotations

import errno

import pytest

from tandem import cli
from tandem.config import DEFAULT_MAX_QUEUE_LEN, ConfigError, ServerConfig
from tandem.engine.supervisor import CrashLoopGuard
from tandem.server.cli import bind_socket, server_config_from_args


def test_a_second_server_on_the_same_port_fails_the_early_check():
    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(OSError) as info:
            bind_socket("127.0.0.1", port)
        assert info.value.errno == errno.EADDRINUSE
    finally:
        first.close()
    bind_socket("127.0.0.1", port).close()  # free again once the first is gone


def test_serve_flags_map_onto_server_config():
    args = cli.build_parser().parse_args(
        ["serve", "--log-level", "info", "--port", "9001", "--served-model-name", "a", "b", "--core-restart-limit",
         "5", "--core-restart-window", "30", "--instance-id", "i-1", "--shutdown-timeout", "2"])
    assert args.log_level == "INFO"
    assert args.max_queue_len == DEFAULT_MAX_QUEUE_LEN == 1024
    assert server_config_from_args(args) == ServerConfig(
        port=9001, served_model_names=("a", "b"), core_restart_limit=5, core_restart_window=30.0,
        instance_id="i-1", shutdown_timeout=2.0, api_key=args.api_key)
    assert cli.build_parser().parse_args(["--log-level", "ERROR", "serve"]).log_level == "ERROR"


@pytest.mark.parametrize("field, value, message", [
    ("port", 70000, "port must be 0-65535, got 70000"),
    ("core_restart_limit", 0, "core_restart_limit must be an integer >= 1, got 0"),
    ("core_restart_window", 0.0, "core_restart_window must be a finite number > 0, got 0.0"),
    ("shutdown_timeout", -1.0, "shutdown_timeout must be a finite number >= 0, got -1.0"),
    ("served_model_names", ("",), "served model names must not be empty"),
])
def test_server_config_refuses_bad_values(field, value, message):
    with pytest.raises(ConfigError) as info:
        ServerConfig(**{field: value})
    assert str(info.value) == message


def test_crash_loop_guard_counts_deaths_in_the_window():
    guard = CrashLoopGuard(limit=3, window_s=60.0)
    assert guard.record_death(0.0) and guard.record_death(10.0)
    assert not guard.record_death(59.0)  # the third within 60 s
    later = CrashLoopGuard(limit=3, window_s=60.0)
    assert later.record_death(0.0) and later.record_death(10.0) and later.record_death(71.0)  # 0.0 expired
    assert not CrashLoopGuard(limit=1).record_death(0.0)


class FakeLLM:
    def __init__(self) -> None:
        self.turns: list[list[dict]] = []

    def get_default_sampling_params(self):
        from tandem.sampling_params import SamplingParams

        return SamplingParams()

    def chat_stream(self, messages, params):
        self.turns.append([dict(m) for m in messages])
        yield "hello"


def test_chat_commands_are_not_sent_to_the_model(monkeypatch, capsys):
    llm = FakeLLM()
    monkeypatch.setattr(cli, "_llm_from_args", lambda args: llm)
    lines = iter(["hi", "/rest", "/reset", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    args = cli.build_parser().parse_args(["chat"])
    assert cli.cmd_chat(args) == 0
    assert [[m["content"] for m in turn] for turn in llm.turns] == [["hi"], ["again"]]
    err = capsys.readouterr().err.splitlines()
    assert err[1] == f"unknown command '/rest'; {cli.CHAT_HELP}"
    assert err[2] == "[history cleared]"

