"""``POST /v1/completions``.

A list prompt becomes one engine prompt per entry; choice ``i * n + j`` is completion ``j`` of prompt
``i`` (the OpenAI and vLLM order). Streams are Server-Sent Events ending with ``data: [DONE]``; the
usage chunk (``choices: []``) comes last when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError, RequestStream
from tandem.engine.processor import PromptError, check_context
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    completion_logprobs,
)
from tandem.server.serving_common import (
    DONE,
    ModelNames,
    check_queue_room,
    event_stream,
    final_outputs,
    merge_streams,
    open_streams,
    request_id_for,
    sse,
    stream_error,
)


class OpenAIServingCompletion:
    """Handles ``/v1/completions`` on top of an ``AsyncLLM``."""

    def __init__(self, engine: AsyncLLM, model_names: ModelNames) -> None:
        self.engine = engine
        self.model_names = model_names
        self.tokenizer = engine.tokenizer

    @staticmethod
    def _prompt_list(prompt: Any) -> list[Any]:
        """The request's prompts: one string or id list becomes a list of one.

        Raises:
            PromptError: no prompt at all.
        """
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise PromptError("the prompt is empty")
        return prompt

    def _tokenize(self, prompts: list[Any], echo: bool) -> list[tuple[str | None, list[int]]]:
        """(text, ids) of each prompt; with ``echo`` the text of a token-id prompt is decoded here too.
        Runs in the tokenizer thread. Raises: PromptError."""
        out = [self.engine.tokenize(p) for p in prompts]
        if echo:
            out = [(self.engine.decode(ids) if text is None else text, ids) for text, ids in out]
        return out

    async def create(self, request: CompletionRequest, arrival_time: float | None = None
                     ) -> JSONResponse | StreamingResponse:
        """Answers one completions request (JSON, or an SSE stream when ``stream`` is set).
        ``arrival_time``: ``time.monotonic()`` when the handler got it (default: now).

        Raises:
            APIError (404), PromptError / SamplingParamsError / ContextLengthExceededError /
            DuplicateRequestError (400), EngineRequestError (400/429), EngineDeadError (503).
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        model = self.model_names.resolve(request.model)
        self.engine.check_available()
        params = request.sampling_params(self.engine.default_sampling_params)
        given = self._prompt_list(request.prompt)
        check_queue_room(self.engine, len(given), params.n)
        request_id = request_id_for("cmpl", request.request_id)
        kind = "delta" if request.stream else "cumulative"
        with self.engine.admitted(len(given) * params.n):
            prompts = await self.engine.run_in_tokenizer(self._tokenize, given, request.echo)
            for _, ids in prompts:
                check_context(self.engine.max_model_len, len(ids), params.max_tokens, "prompt")
            streams = await open_streams(self.engine, request_id, prompts, params, kind, arrival)
        created = int(time.time())
        if request.stream:
            return event_stream(self._stream(request, request_id, created, model, streams, prompts, params))
        outs = await final_outputs(streams)
        return JSONResponse(self._response(request, request_id, created, model, outs, prompts, params)
                            .model_dump())

    @staticmethod
    def _echo(request: CompletionRequest, prompt: tuple[str | None, list[int]]) -> str:
        """The prompt text to prepend (decoded in the tokenizer thread by ``_tokenize``), or ""."""
        return (prompt[0] or "") if request.echo else ""

    def _response(
        self, request: CompletionRequest, request_id: str, created: int, model: str,
        outs: list[RequestOutput], prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
    ) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, out in enumerate(outs):
            prefix = self._echo(request, prompts[i])
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs, _ = completion_logprobs(
                        self.tokenizer, c.token_ids, c.logprobs or [], params.logprobs, len(prefix))
                choices.append(CompletionChoice(index=i * params.n + c.index, text=prefix + c.text,
                                                logprobs=logprobs, finish_reason=c.finish_reason))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                  kv_transfer_params=outs[0].kv_transfer_params if len(outs) == 1 else None)

    async def _stream(
        self, request: CompletionRequest, request_id: str, created: int, model: str,
        streams: list[RequestStream], prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
    ) -> AsyncIterator[str]:
        exclude = None if request.include_usage else {"usage"}
        offsets: dict[int, int] = {}
        completion_tokens = 0
        try:
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    index = i * params.n + c.index
                    text = c.text
                    if index not in offsets:
                        text = self._echo(request, prompts[i]) + text
                        offsets[index] = len(text) - len(c.text)
                    completion_tokens += len(c.token_ids)
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs, offsets[index] = completion_logprobs(
                            self.tokenizer, c.token_ids, c.logprobs or [], params.logprobs, offsets[index])
                    # NOTE: one chunk per step with new tokens, even when their text is empty (special
                    # tokens, held-back stop-string prefixes), as vLLM does, so clients' ITL is comparable.
                    if not c.token_ids and not text and c.finish_reason is None:
                        continue
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason)
                    yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                                 choices=[choice]), exclude)
            if request.include_usage:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=usage))
        except (EngineDeadError, EngineRequestError) as e:
            yield stream_error(e)
        finally:
            for stream in streams:
                stream.abort()
        yield DONE
