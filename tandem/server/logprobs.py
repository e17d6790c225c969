"""Logprobs in the OpenAI response shapes (completions, chat) and vLLM's ``prompt_logprobs`` field."""

from __future__ import annotations

from typing import Any

from tandem.outputs import PositionLogprobs, PromptLogprobs
from tandem.server.protocol_responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobEntry,
    PromptLogprobsJSON,
)

MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (OpenAI's and vLLM's clamp)
EchoOffsets = tuple[list[int], int] | None  # an echoed text prompt: its tokens' offsets, its length


def echo_offsets(tokenizer: Any, text: str, token_ids: list[int]) -> EchoOffsets:
    """Where each of ``token_ids`` (the tokenization of ``text``) starts in ``text``, and its length;
    None when the tokenizer gives no offset mapping (a slow tokenizer) or tokenizes differently."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    encoding = tokenizer(text, return_offsets_mapping=True)
    if list(encoding["input_ids"]) != token_ids:
        return None
    return [start for start, _ in encoding["offset_mapping"]], len(text)


def token_text(tokenizer: Any, token_id: int, logprob: Any = None) -> str:
    """The text of one token as OpenAI shows it (the detokenized token, not the BPE symbol)."""
    decoded = getattr(logprob, "decoded_token", None)
    return decoded if decoded is not None else tokenizer.decode([token_id])


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` rendering of a token: ``"token_id:{id}"``."""
    return f"token_id:{token_id}"


def _top(position: PositionLogprobs, num: int) -> list[tuple[int, Any]]:
    """The ``num`` most likely entries of one position, by rank."""
    return sorted(position.items(), key=lambda kv: kv[1].rank)[:num]


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs | None], num: int, text_offset: int,
    prompt: EchoOffsets = None, as_token_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """Completions ``logprobs`` for these tokens; ``text_offset`` is the character offset of the
    first one. Returns the object and the offset after the last token. ``text_offset[i]`` is where
    token i starts in the choice's text: each token's text length is added to the next offset, except
    for the echoed text prompt ``prompt = (offsets, characters)``, whose first tokens have their
    offsets in the prompt string (the tokenizer's offset mapping: BOS is a zero-length token at 0, a
    leading space marker adds no character) and after which the output starts at ``characters``.

    ``top_logprobs`` holds the ``num`` most likely tokens plus the chosen one (OpenAI: up to
    ``logprobs + 1`` entries). A None position (the prompt's first token, under ``echo``) gives a
    null logprob and null top (OpenAI's format). -inf is sent as -9999.0.

    ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``): ``tokens`` and the ``top_logprobs`` keys are
    ``"token_id:{id}"``; ``text_offset`` still indexes the text. NOTE: vLLM advances its offsets by the
    length of the ``token_id:`` string instead; Tandem keeps them pointing into the returned text.
    """
    out = CompletionLogprobs()
    prompt_offsets, prompt_chars = prompt if prompt is not None else ([], 0)
    next_offset = text_offset + prompt_chars  # where the next output token starts
    for i, (token_id, position) in enumerate(zip(token_ids, positions, strict=False)):
        if position is None:
            text = tokenizer.decode([token_id])
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = position[token_id]  # NOTE: each position holds the chosen token plus the top-N
            text = token_text(tokenizer, token_id, chosen)
            out.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB))
            top = {token_id_text(t) if as_token_ids else token_text(tokenizer, t, lp): max(lp.logprob, MIN_LOGPROB)
                   for t, lp in _top(position, num)}
            if chosen.rank > num:
                top.setdefault(token_id_text(token_id) if as_token_ids else text, max(chosen.logprob, MIN_LOGPROB))
            out.top_logprobs.append(top)
        out.tokens.append(token_id_text(token_id) if as_token_ids else text)
        if i < len(prompt_offsets):
            out.text_offset.append(text_offset + prompt_offsets[i])
        else:
            out.text_offset.append(next_offset)
            next_offset += len(text)
    return out, next_offset


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's ``prompt_logprobs`` response field: token id (a JSON key) -> logprob, rank, text."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else {
        str(t): PromptLogprobEntry(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in position.items()} for position in prompt_logprobs]


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs], num: int, as_token_ids: bool = False,
) -> ChatLogprobs:
    """Chat ``logprobs.content``: one entry per token, each with its ``num`` top alternatives.

    ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``): every ``token`` is ``"token_id:{id}"``. As in
    vLLM, the sampled token's ``bytes`` stay those of its text, while an alternative's are those of the
    ``token_id:`` string shown for it.
    """
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = position[token_id]
        text = token_text(tokenizer, token_id, sampled)
        top = []
        for t, lp in _top(position, num):
            alt = token_id_text(t) if as_token_ids else token_text(tokenizer, t, lp)
            top.append(ChatTopLogprob(token=alt, logprob=lp.logprob, bytes=list(alt.encode("utf-8"))))
        content.append(ChatTokenLogprob(
            token=token_id_text(token_id) if as_token_ids else text, logprob=sampled.logprob,
            bytes=list(text.encode("utf-8")), top_logprobs=top,
        ))
    return ChatLogprobs(content=content)
