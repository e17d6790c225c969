"""``POST /v1/completions``, plus the helpers both OpenAI endpoints share (model names, SSE, streams).

A list prompt becomes one engine prompt per entry; choice ``i * n + j`` is completion ``j`` of prompt
``i`` (the OpenAI and vLLM order). Streams are Server-Sent Events ending with ``data: [DONE]``; the
usage chunk (``choices: []``) comes last when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from tandem.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError, RequestStream
from tandem.engine.processor import PromptError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server import errors
from tandem.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    completion_logprobs,
)

DONE = "data: [DONE]\n\n"


class ModelNames:
    """The names this server answers to; the first one is the default."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)

    def resolve(self, requested: str | None) -> str:
        """The name to echo in responses.

        Raises:
            APIError: 404 when ``requested`` is not served here.
        """
        if requested is None or requested == "":
            return self.names[0]
        if requested not in self.names:
            raise errors.model_not_found(requested)
        return requested


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    data = payload.model_dump(exclude=exclude) if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stream_error(e: EngineDeadError | EngineRequestError) -> str:
    """The error event sent when a stream fails after its 200 header went out."""
    return sse(errors.from_engine_error(e).body())


def event_stream(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def check_queue_room(engine: AsyncLLM, num_prompts: int, n: int) -> None:
    """Refuses a request that needs more engine requests (prompts x n) than the waiting queue can ever
    hold: all of them may have to wait at once, so it could only ever get 429. 400, not 429, so
    clients do not retry it.

    Raises:
        APIError: 400 (param ``n``, or ``prompt`` when the number of prompts is the cause).
    """
    limit, needed = engine.max_queue_len, num_prompts * n
    if limit and needed > limit:
        raise errors.bad_request(
            f"this request needs {needed} engine requests ({num_prompts} prompt(s) x n={n}) but the waiting "
            f"queue holds at most {limit} (--max-queue-len); it can never be accepted",
            "n" if n > limit else "prompt")


def check_context(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
    """vLLM's 400 for an explicit ``max_tokens`` that does not fit after the prompt (absent or null
    ``max_tokens`` means "up to the context" and always fits). A prompt that alone fills the context
    is left to ``InputProcessor.make_requests``, whose message says so.

    Raises:
        PromptError: ``num_prompt_tokens + max_tokens > max_model_len`` (code context_length_exceeded).
    """
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        return
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.", param)


async def open_streams(
    engine: AsyncLLM, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
    output_kind: str,
) -> list[RequestStream]:
    """Queues every prompt; if one is refused, aborts those already queued and re-raises.

    Raises:
        PromptError, EngineRequestError, EngineDeadError: see ``AsyncLLM.add_request``.
    """
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await engine.add_request(rid, text, ids, params, output_kind))
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several prompts as they come: ``(prompt index, output)``; raises the first error."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished (cumulative) output of each stream; aborts all of them on any error."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        assert final is not None and final.finished
        return final

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        for stream in streams:
            stream.abort()


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

    def _tokenize(self, prompts: list[Any]) -> list[tuple[str | None, list[int]]]:
        """(text, ids) of each prompt; runs in the tokenizer thread. Raises: PromptError."""
        return [self.engine.processor.tokenize(p) for p in prompts]

    async def create(self, request: CompletionRequest) -> JSONResponse | StreamingResponse:
        """Answers one completions request (JSON, or an SSE stream when ``stream`` is set).

        Raises:
            APIError (404), PromptError / SamplingParamsError (400), EngineRequestError (400/429),
            EngineDeadError (503).
        """
        model = self.model_names.resolve(request.model)
        if self.engine.dead is not None:
            raise self.engine.dead
        params = request.sampling_params(self.engine.frontend.default_sampling_params)
        given = self._prompt_list(request.prompt)
        check_queue_room(self.engine, len(given), params.n)
        prompts = await self.engine.run_in_tokenizer(self._tokenize, given)
        for _, ids in prompts:
            check_context(self.engine.max_model_len, len(ids), params.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        kind = "delta" if request.stream else "cumulative"
        streams = await open_streams(self.engine, request_id, prompts, params, kind)
        created = int(time.time())
        if request.stream:
            return event_stream(self._stream(request, request_id, created, model, streams, prompts, params))
        outs = await final_outputs(streams)
        return JSONResponse(self._response(request, request_id, created, model, outs, prompts, params)
                            .model_dump())

    def _echo(self, request: CompletionRequest, prompt: tuple[str | None, list[int]]) -> str:
        if not request.echo:
            return ""
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids)

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
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

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
