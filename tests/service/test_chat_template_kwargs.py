"""vLLM's ``chat_template_kwargs`` reach the chat template (they were silently dropped: Qwen3's
``enable_thinking: false`` had no effect), a key that is an ``apply_chat_template`` parameter is a 400,
and vLLM's chat extras Tandem does not honour (``chat_template``, ``documents``,
``continue_final_message``, ``echo``) are a 400 naming the field instead of being ignored."""

from __future__ import annotations

import httpx
import pytest
from live_server import Server
from transformers import AutoTokenizer

# A ChatML template with one variable of its own, as Qwen3's ``enable_thinking``.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'Once upon a time' }}{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell a story."}]


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kwargs")
    (folder / "template.jinja").write_text(TEMPLATE)
    s = Server(stories_dir, folder / "server.log", "--chat-template", str(folder / "template.jinja"))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def chat(server, **extra):
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_chat_template_kwargs_are_template_variables(server, stories_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    plain = tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    thinking_off = plain + "Once upon a time"
    for kwargs, text in (({"enable_thinking": False}, thinking_off), ({"enable_thinking": True}, plain),
                         (None, plain), ({}, plain)):
        r = chat(server, chat_template_kwargs=kwargs)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(tokenizer(thinking_off, add_special_tokens=False)["input_ids"]) > \
        len(tokenizer(plain, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "tools", "chat_template", "messages",
                                 "not an identifier"])
def test_render_parameters_are_refused_as_template_kwargs(server, key):
    r = chat(server, chat_template_kwargs={key: True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert r.json()["error"]["message"] == f"chat_template_kwargs: may not set {key!r}"


@pytest.mark.parametrize(("field", "value"), [("chat_template", "{{ raise_exception('boom') }}"),
                                              ("documents", [{"title": "a", "text": "b"}]),
                                              ("continue_final_message", True), ("echo", True)])
def test_unhonoured_vllm_chat_fields_are_refused(server, field, value):
    r = chat(server, **{field: value})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"{field} is not supported", "type": "invalid_request_error",
                                 "param": field, "code": None}
    # Their defaults stay accepted.
    default = {"chat_template": None, "documents": None, "continue_final_message": False, "echo": False}[field]
    assert chat(server, **{field: default}).status_code == 200


def test_tokenize_renders_messages_with_the_same_kwargs(server):
    """``/tokenize`` with ``messages`` counts the prompt chat completions would build from the same body."""
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
        tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": kwargs},
                               timeout=60)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["count"] == chat(server, chat_template_kwargs=kwargs).json()["usage"]["prompt_tokens"]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
