"""The router's view of a request body: its prompt's token ids and block hashes, and its token cost.

The router never changes a body; it reads it to route. A completions ``prompt`` (a string, token
ids, or a list of them: the first is routed on) is tokenized as Tandem's front end does
(``tokenizer(text)``, with BOS); chat ``messages`` are rendered with the chat template
(``--chat-template`` or the tokenizer's own, ``add_generation_prompt=True``) and tokenized without
special tokens (``engine/processor.py``), so the chained block hashes
(``kv_cache.hashing.hash_token_blocks``) equal the engine's prefix-cache keys.

Without a tokenizer (round-robin / least-load only) the prompt has no hashes and its length is
estimated at 4 characters per token. A text longer than ``MAX_ROUTED_CHARS`` is routed on its first
``MAX_ROUTED_CHARS`` characters (their tokens minus the last block's worth, which the cut may have
changed; the rest estimated at 4 characters per token): tokenizing a multi-megabyte prompt took
the router's worker threads tens of seconds while the backend rejects it at once, and a shared
prefix sits at the start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.kv_cache.hashing import hash_token_blocks

CHARS_PER_TOKEN = 4  # the estimate without a tokenizer
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default, charged when a body names none
MAX_ROUTED_CHARS = 1 << 18  # characters of a prompt text the router tokenizes (about 64k tokens)


@dataclass(frozen=True)
class RoutedPrompt:
    """What routing needs of one request.

    Attributes:
        block_hashes: chained hashes of the prompt's full blocks (empty without a tokenizer).
        num_prompt_tokens: exact with a tokenizer, else estimated.
        num_tokens: ``num_prompt_tokens`` + the requested output tokens (the load it adds).
        stream: the body asked for an SSE stream.
    """

    block_hashes: Sequence[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    stream: bool = False


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            n = body.get("n", 1)
            return value * (n if isinstance(n, int) and n > 0 else 1)
    return DEFAULT_MAX_TOKENS


class PromptReader:
    """Reads bodies into ``RoutedPrompt``s.

    Args:
        tokenizer: a ``transformers`` tokenizer of the backends' model, or None.
        block_size: tokens per KV block (the backends' ``--block-size``).
        chat_template: a Jinja template overriding the tokenizer's own, or None.
    """

    def __init__(self, tokenizer: Any | None, block_size: int, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.chat_template = chat_template

    def read(self, raw: bytes, chat: bool) -> RoutedPrompt:
        """The routing view of a raw JSON body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``.

        A body the router cannot read (not JSON, no prompt, a template error) is routed with no
        hashes: the backend, not the router, answers it with its own error. Thread-safe (no state).

        Raises:
            RecursionError: JSON nested deeper than the interpreter's recursion limit (the router answers 400).
        """
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return RoutedPrompt()
        if not isinstance(body, dict):
            return RoutedPrompt()
        stream = body.get("stream") is True
        ids, text = self._prompt(body, chat)
        if ids is None:
            n = len(text) // CHARS_PER_TOKEN if text else 0
            return RoutedPrompt([], n, n + _max_tokens(body), stream)
        n = len(ids) + max(0, len(text) - MAX_ROUTED_CHARS) // CHARS_PER_TOKEN
        return RoutedPrompt(hash_token_blocks(ids, self.block_size), n, n + _max_tokens(body), stream)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``, or of its first ``MAX_ROUTED_CHARS`` characters minus the last
        ``block_size`` tokens when it is longer (see the module docstring)."""
        ids = list(self.tokenizer(text[:MAX_ROUTED_CHARS], add_special_tokens=add_special_tokens)["input_ids"])
        return ids if len(text) <= MAX_ROUTED_CHARS else ids[:max(0, len(ids) - self.block_size)]

    def _prompt(self, body: dict[str, Any], chat: bool) -> tuple[list[int] | None, str]:
        """(token ids or None, text) of the prompt."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None, ""
            if self.tokenizer is None:
                return None, json.dumps(messages)
            try:
                text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                          tokenize=False, add_generation_prompt=True)
            except Exception:  # NOTE: Jinja raises many types; the backend reports the user's error.
                return None, json.dumps(messages)
            return self._encode(text, False), text
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
            prompt = prompt[0]  # a batch goes to one backend: route on its first prompt
        if _is_ids(prompt):
            return list(prompt), ""
        if not isinstance(prompt, str) or not prompt:
            return None, ""
        if self.tokenizer is None:
            return None, prompt
        return self._encode(prompt, True), prompt
