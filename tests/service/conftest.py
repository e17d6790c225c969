"""Fixtures of the service tests (helpers live in live_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from live_server import API_KEY, CHATML, MODEL, Server
from transformers import AutoTokenizer


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


@pytest.fixture(scope="session")
def api_client(api_server):
    """The official `openai` client of ``api_server`` (no retries)."""
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def stories_tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(str(stories_dir))


@pytest.fixture(scope="session")
def golden_cases(stories_dir):
    """The transformers greedy continuations shipped with stories260K, by prompt (``prompt_token_ids``,
    ``greedy_token_ids``, ``greedy_text``)."""
    cases = json.loads((stories_dir / "golden.json").read_text())["cases"]
    return {c["prompt"]: c for c in cases if c["prompt"]}


# Flags of servers that several modules share (``server_pool``): name -> flags.
SHARED_FLAGS = {
    # test_load.py (queue bound 8, 4 running) then test_supervision.py (restart limit 2 in 600 s; it kills the core)
    "busy": ("--max-queue-len", "8", "--max-num-seqs", "4", "--instance-id", "test-instance",
             "--core-restart-limit", "2", "--core-restart-window", "600"),
}


class ServerPool:
    """Servers shared by the modules that need the same flags (``SHARED_FLAGS``), one start-up for all of them.

    A module that leaves its server unusable (kills its core for good, or the front end) ``retire``s it, so a
    later user starts a new one: the modules pass in any order.
    """

    def __init__(self, model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.model, self.tmp_path_factory = model, tmp_path_factory
        self.servers: dict[str, Server] = {}

    def start(self, name: str) -> Server:
        """The running server ``name``, or a new one (started, not yet healthy: call ``wait_healthy``)."""
        if name not in self.servers:
            log = self.tmp_path_factory.mktemp(f"shared-{name}") / "server.log"
            self.servers[name] = Server(self.model, log, *SHARED_FLAGS[name])
        return self.servers[name]

    def retire(self, name: str) -> None:
        """Stops the server ``name`` (if running); the next ``start`` makes a new one."""
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()

    def close(self) -> None:
        for name in list(self.servers):
            self.retire(name)


@pytest.fixture(scope="session")
def server_pool(stories_dir, tmp_path_factory):
    pool = ServerPool(stories_dir, tmp_path_factory)
    try:
        yield pool
    finally:
        pool.close()
