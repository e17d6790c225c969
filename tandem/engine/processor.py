"""Front-end input processing: prompt -> validated engine ``Request``s (tokenize, chat template, n)."""

from __future__ import annotations

import json
import logging
import numbers
from collections.abc import Sequence
from typing import Any

from tandem.errors import ContextLengthExceededError, context_length_message
from tandem.request import Request
from tandem.sampling_params import SamplingParams, SamplingParamsError, child_seed

logger = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot serve (empty, too long, bad token ids, failing chat template).

    ``param`` names the offending request field (OpenAI error ``param``).
    """

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.param = param


PromptType = str | list[int] | dict[str, Any]


def check_context(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, param: str = "prompt") -> None:
    """Refuses a prompt that leaves no room for the completion, or an explicit ``max_tokens`` that does
    not fit after it (vLLM's 400; absent or null ``max_tokens`` means "up to the context").

    ``param``: the request field holding the prompt ("prompt" for completions, "messages" for chat);
    it is named in the message and the error.

    ``max_tokens`` 0 (the prompt alone, for its logprobs) needs no room: the prompt may fill the context.

    Raises:
        ContextLengthExceededError: ``num_prompt_tokens >= max_model_len`` (``>`` for ``max_tokens`` 0)
            or ``num_prompt_tokens + max_tokens > max_model_len``.
    """
    if num_prompt_tokens >= max_model_len and max_tokens != 0:
        raise ContextLengthExceededError(context_length_message(
            max_model_len, f"you requested {num_prompt_tokens} tokens in the {param}, which leaves no room for "
            f"the completion. Please reduce the length of the {param}."), num_prompt_tokens, max_model_len, param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceededError(context_length_message(
            max_model_len, f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{param}, {max_tokens} in the completion). Please reduce the length of the {param} or completion."),
            num_prompt_tokens + max_tokens, max_model_len, param)

# Normalizers and pre-tokenizers that never delete characters; the value bounds how much a
# normalizer can shrink the text (NFC/NFKC compose at most 4 code points into one, e.g. U+1F82).
_SAFE_NORMALIZERS = {"Prepend": 1, "Lowercase": 1, "NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _shrink_factor(normalizer: dict[str, Any] | None) -> int | None:
    """How many times shorter normalized text can be than its input; None if unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            sub = _shrink_factor(part)
            if sub is None:
                return None
            factor *= sub
        return factor
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return None if pattern is None or not content else max(1, -(-len(pattern) // len(content)))
    return _SAFE_NORMALIZERS.get(kind)


def _keeps_all_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_all_characters(p) for p in pre_tokenizer.get("pretokenizers", []))
    if pre_tokenizer.get("type") == "Split" and pre_tokenizer.get("behavior") == "Removed":
        return False
    return pre_tokenizer.get("type") in _SAFE_PRE_TOKENIZERS


def _component(part: Any) -> dict[str, Any] | None:
    """A tokenizers normalizer / pre-tokenizer as its JSON description (None stays None)."""
    return None if part is None else json.loads(part.__getstate__())


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """A length in characters beyond which a prompt cannot fit ``max_model_len`` tokens, or None
    when the tokenizer gives no such bound.

    Bound: the tokenizer splits the normalized text into pieces, each matching one vocabulary
    entry, and no piece covers more characters than its entry is long (a byte-level entry spells
    one byte per character and a character is at least one byte; a ``<0xE2>`` byte piece covers one
    byte). So ``tokens >= normalized_chars / L`` with ``L`` the longest entry, and
    ``normalized_chars >= chars / shrink`` with ``shrink`` the normalizer's worst contraction. A
    prompt of more than ``max_model_len * L * shrink`` characters therefore needs more than
    ``max_model_len`` tokens. The bound only holds if no step drops text, so it is None for
    normalizers or pre-tokenizers that delete or collapse characters (BERT's whitespace split, a
    regex replace), added tokens that swallow neighbouring spaces (lstrip/rstrip), and models that
    fuse a run of unknown characters into one token (BPE without byte fallback, outside byte-level).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    shrink = _shrink_factor(_component(backend.normalizer))
    pre_tokenizer = _component(backend.pre_tokenizer)
    if shrink is None or not _keeps_all_characters(pre_tokenizer):
        return None
    model = backend.model
    if '"ByteLevel"' not in json.dumps(pre_tokenizer) and not getattr(model, "byte_fallback", False):
        # NOTE: without bytes to fall back on, an unknown character becomes <unk>: one per character
        # only in a BPE model with fuse_unk off (others fuse runs, or drop them when there is no unk).
        if type(model).__name__ != "BPE" or model.unk_token is None or model.fuse_unk:
            return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in added):
        return None
    longest = max(len(entry) for entry in tokenizer.get_vocab())
    return max_model_len * longest * shrink


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
        self._tools_checked: set[str | None] = set()  # templates whose handling of ``tools`` was checked
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)

    def check_structured_outputs(self, params: SamplingParams, param: str = "structured_outputs") -> None:
        """Refuses a constraint the grammar engine cannot enforce (about a millisecond for a schema).

        Raises:
            SamplingParamsError: an unimplemented JSON-schema keyword (named in the message), an invalid
                schema, regex or grammar; ``param`` is the request field to name.
        """
        if params.structured_outputs is None:
            return
        from tandem.structured_outputs import check_grammar

        check_grammar(params.structured_outputs, None, param)

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """Refuses, before tokenizing, a text too long to fit the context whatever its tokens.

        Raises:
            ContextLengthExceededError: ``text`` is longer than ``max_prompt_chars`` characters.
        """
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            verb = "have" if param == "messages" else "has"
            raise ContextLengthExceededError(context_length_message(
                self.max_model_len, f"the {param} {verb} {len(text)} characters, more than the "
                f"{self.max_prompt_chars} that {self.max_model_len} tokens can hold with this tokenizer. "
                f"Please reduce the length of the {param}."), len(text), self.max_model_len, param)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, token ids); adds the tokenizer's BOS like transformers does.

        Accepts a string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``.

        Raises:
            PromptError: empty prompt, ids out of the vocabulary, a text too long to ever fit the
                context (``check_prompt_chars``), or an unsupported prompt type.
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
            self.check_prompt_chars(prompt)
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt
        ):
            ids = [int(t) for t in prompt]
            if not ids:
                raise PromptError("the prompt is empty")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
            return None, ids
        raise PromptError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Renders chat ``messages`` with the model's chat template (or ``chat_template``) into text;
        ``tools`` (OpenAI function specs) are handed to the template as transformers does, and
        ``template_kwargs`` (vLLM's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) as extra
        template variables.

        The first request with ``tools`` also renders its messages without them: a template that
        ignores ``tools`` is logged as a WARNING, once per template.

        Raises:
            PromptError: no template, or the template fails on these messages.
        """
        template = chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("the model has no chat template; pass one with --chat-template", "messages")
        if not messages:
            raise PromptError("messages must not be empty", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt, tools=tools, **(template_kwargs or {}),
            )
            if tools and template not in self._tools_checked:
                self._check_renders_tools(text, messages, add_generation_prompt, template)
            return text
        except Exception as e:  # NOTE: Jinja raises many types; all are the user's template/message problem.
            raise PromptError(f"the chat template failed on these messages: {e}", "messages") from e

    def _check_renders_tools(self, text: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                             template: str | None) -> None:
        """Logs a WARNING (once per template) when ``template`` renders the same prompt without the
        tools: the model is never shown them (SmolLM2's own template, for one). Changes: the checked set."""
        self._tools_checked.add(template)
        plain = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
        if plain == text:
            logger.warning("the chat template ignores `tools`: requests with tools get the same prompt as without "
                           "them, so the model never sees the tool definitions; pass a template that renders "
                           "them with --chat-template")

    def chat_prompt_ids(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt; the template already carries BOS, so add none.

        Raises:
            PromptError: an empty prompt, or one too long to fit (``check_prompt_chars``).
        """
        self.check_prompt_chars(text, "messages")
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
            ContextLengthExceededError: the prompt leaves no room to generate within ``max_model_len``.
            SamplingParamsError: a stop token id outside the vocabulary.
        """
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise SamplingParamsError(
                f"stop token id {bad_stop[0]} is out of the vocabulary [0, {self.vocab_size})", "stop_token_ids"
            )
        n_prompt = len(prompt_token_ids)
        check_context(self.max_model_len, n_prompt, 0 if params.max_tokens == 0 else None)
        room = self.max_model_len - n_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        requests = []
        for i in range(params.n):
            child = params if params.n == 1 or params.seed is None else params.clone(seed=child_seed(params.seed, i))
            req_id = request_id if params.n == 1 else f"{i}_{request_id}"
            requests.append(Request(
                request_id=req_id, prompt_token_ids=list(prompt_token_ids), sampling_params=child,
                eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
            ))
        return requests
