"""OpenAI response schemas (pydantic) of completions, chat completions and ``/v1/models``, with vLLM's
extras (``prompt_logprobs``, ``kv_transfer_params``, each choice's ``stop_reason``) and
``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits); the request schemas are in ``protocol.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """Usage with ``prompt_tokens_details.cached_tokens`` (prefix-cache hits, as OpenAI reports them)."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprobEntry(BaseModel):
    """One candidate of vLLM's ``prompt_logprobs``: its logprob, vLLM rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's response shape: per prompt token (the first one null) its token and the top-N, by token id.
PromptLogprobsJSON = list[dict[str, PromptLogprobEntry] | None]


# vLLM's ``stop_reason`` of a choice: the stop string (str) or stop token id (int) that ended it; None when
# it ended on EOS, on length, or has not ended (a stream's earlier chunks).
StopReason = int | str | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM's extra (request field prompt_logprobs)
    # vLLM's extras (request field return_token_ids); in a stream token_ids are the chunk's new ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ResponseBase(BaseModel):
    """Fields every completion and chat completion response (and chunk) carries."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's field (disaggregated prefill)


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = None  # vLLM's extra (request field return_token_ids)


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM's extra (request field prompt_logprobs)
    prompt_token_ids: list[int] | None = None  # vLLM's extra (request field return_token_ids)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
