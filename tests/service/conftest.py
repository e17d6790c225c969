"""Fixtures of the service tests (helpers live in live_server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from live_server import API_KEY, CHATML, MODEL, Server


@pytest.fixture(scope="session")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small ChatML template (stories260K ships none)."""
    path = tmp_path_factory.mktemp("templates") / "chatml.jinja"
    path.write_text(CHATML)
    return path


@pytest.fixture(scope="session")
def api_server(stories_dir, chat_template_file, tmp_path_factory):
    """One server shared by the API modules: stories260K, ChatML template, an API key, two names. After all
    of them (structured output included) it still shuts down cleanly: exit code 0."""
    s = Server(stories_dir, tmp_path_factory.mktemp("api") / "server.log", "--chat-template",
               str(chat_template_file), "--api-key", API_KEY, "--served-model-name", MODEL, "stories-alias")
    try:
        s.wait_healthy()
        yield s
    finally:
        code = s.stop()
    assert code == 0, s.log()
