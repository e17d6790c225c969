"""`tandem serve` start-up failures: one clear error line, no traceback, a non-zero exit, and no wait
for a model that is not needed (a busy port and a bad --chat-template fail before the model loads)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from live_server import ROOT, free_port

from tandem.engine.loading import load_chat_template


@pytest.fixture(scope="module")
def failures(api_server, stories_dir, tmp_path_factory):
    """Runs the failing commands side by side; returns {case: (exit code, stderr)}."""
    broken = tmp_path_factory.mktemp("templates") / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    cases = {
        "port in use": ["--port", str(api_server.port)],
        "port out of range": ["--port", "99999"],
        "no template file": ["--chat-template", "/nonexistent/t.jinja"],
        "template syntax": ["--chat-template", str(broken)],
        "context too long": ["--max-model-len", "4096"],
    }
    procs = {}
    for name, flags in cases.items():
        port = [] if "--port" in flags else ["--port", str(free_port())]
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(stories_dir), "--dtype", "float32",
               "--num-threads", "1", *port, *flags]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        results[name] = (proc.returncode, err)
    return results, broken


def test_busy_port_fails_before_loading(failures, api_server):
    results, _ = failures
    code, err = results["port in use"]
    assert code == 1
    assert err.splitlines() == [f"tandem: error: cannot listen on 127.0.0.1:{api_server.port}: Address already in use"]


def test_port_out_of_range_fails_instead_of_wrapping(failures):
    # ServerConfig refuses it, as every bad flag: exit 2 with one line.
    code, err = failures[0]["port out of range"]
    assert code == 2
    assert err.splitlines() == ["tandem: error: port must be 0-65535, got 99999"]


def test_bad_chat_template_fails_at_startup(failures):
    results, broken = failures
    code, err = results["no template file"]
    assert code == 2
    assert err.splitlines() == ["tandem: error: --chat-template '/nonexistent/t.jinja' is neither an existing file "
                                "nor a Jinja template (it has no '{{' or '{%')"]
    code, err = results["template syntax"]
    assert code == 2
    assert err.splitlines() == [f"tandem: error: the chat template (file {broken}) has a syntax error at line 1: "
                                "unexpected '}'"]


def test_core_failure_is_one_line_and_prompt(failures):
    code, err = failures[0]["context too long"]
    assert code == 1
    assert err.splitlines() == ["tandem: error: the engine core failed to start: ConfigError: max_model_len 4096 "
                                "exceeds the model's max_position_embeddings 512"]


def test_load_chat_template_reads_files_and_inline_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}") == (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="No filter named 'nope'"):
        load_chat_template("{{ messages | nope }}")
    with pytest.raises(ValueError, match="neither an existing file nor a Jinja template"):
        load_chat_template(str(tmp_path))  # a directory is not a template file
