"""Front-end input processing: prompt -> validated engine ``Request``s (tokenize, chat template, n)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.request import Request
from tandem.sampling_params import SamplingParams


class PromptError(ValueError):
    """A prompt the engine cannot serve (empty, too long, bad token ids, failing chat template).

    ``param`` names the offending request field (OpenAI error ``param``).
    """

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.param = param


PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    """Turns user prompts into engine requests; shared by the offline ``LLM`` and the server.

    Args:
        tokenizer: a ``transformers`` tokenizer of the model.
        max_model_len: the context limit in tokens (prompt + output).
        vocab_size: the model's vocabulary size (token ids must be below it).
        eos_token_ids: ids that end generation (from config.json and generation_config.json).
        chat_template: a Jinja template overriding the tokenizer's own, or None.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, token ids); adds the tokenizer's BOS like transformers does.

        Accepts a string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``.

        Raises:
            PromptError: empty prompt, ids out of the vocabulary, or an unsupported prompt type.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise PromptError("the prompt is empty")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
            return None, ids
        raise PromptError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """Renders chat ``messages`` with the model's chat template (or ``chat_template``) into text.

        Raises:
            PromptError: no template, or the template fails on these messages.
        """
        template = chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("the model has no chat template; pass one with --chat-template", "messages")
        if not messages:
            raise PromptError("messages must not be empty", "messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # NOTE: Jinja raises many types; all are the user's template/message problem.
            raise PromptError(f"the chat template failed on these messages: {e}", "messages") from e

    def chat_prompt_ids(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt; the template already carries BOS, so add none."""
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise PromptError("the chat prompt is empty", "messages")
        return ids

    def make_requests(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Request]:
        """One engine ``Request`` per completion (``n`` children with ids ``f"{i}_{request_id}"``).

        Resolves ``max_tokens`` against the context (None = up to ``max_model_len``); a seeded
        request's child i uses seed + i so the n samples differ but stay reproducible.

        Raises:
            PromptError: the prompt leaves no room to generate within ``max_model_len``.
        """
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise PromptError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{n_prompt} tokens (at least one token must remain for the completion)"
            )
        room = self.max_model_len - n_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        requests = []
        for i in range(params.n):
            child = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            req_id = request_id if params.n == 1 else f"{i}_{request_id}"
            requests.append(Request(
                request_id=req_id, prompt_token_ids=list(prompt_token_ids), sampling_params=child,
                eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
            ))
        return requests
