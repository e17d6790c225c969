"""``POST /v1/chat/completions``: messages -> the model's chat template -> one engine prompt.

Streaming follows OpenAI: each choice first gets a chunk with ``delta: {"role": "assistant",
"content": ""}``, then content deltas; the chunk with ``finish_reason`` closes the choice; the usage
chunk (``choices: []``) comes last when asked for, then ``data: [DONE]``. Tool calls (``tools.py``)
arrive as one ``delta.tool_calls`` chunk per choice once its output is complete.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError, RequestStream
from tandem.engine.processor import check_context
from tandem.outputs import CompletionOutput
from tandem.sampling_params import SamplingParams, SamplingParamsError
from tandem.server.logprobs import chat_logprobs, prompt_logprobs_json
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.protocol_responses import ChatChoice, ChatCompletionResponse, ChatResponseMessage, UsageInfo
from tandem.server.serving_common import (
    DONE,
    ModelNames,
    check_constraint,
    check_queue_room,
    event_stream,
    final_outputs,
    open_streams,
    request_id_for,
    sse,
    stream_error,
)
from tandem.server.tools import ToolCalling, ToolCallStream, ToolPlan, extract_calls, finish_reason


class OpenAIServingChat:
    """Handles ``/v1/chat/completions`` on top of an ``AsyncLLM``."""

    def __init__(self, engine: AsyncLLM, model_names: ModelNames, tools: ToolCalling | None = None) -> None:
        self.engine = engine
        self.model_names = model_names
        self.tokenizer = engine.tokenizer
        self.tools = tools or ToolCalling()

    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The templated prompt text and its token ids (runs in the tokenizer thread).

        Raises:
            SamplingParamsError: an unsupported message part. PromptError: the template failed, or
                the prompt is empty or too long to ever fit.
        """
        return self.engine.render_chat(request.template_messages(), request.add_generation_prompt,
                                       request.template_tools(), request.chat_template_kwargs)

    async def create(self, request: ChatCompletionRequest, arrival_time: float | None = None
                     ) -> JSONResponse | StreamingResponse:
        """Answers one chat request (JSON, or an SSE stream when ``stream`` is set).
        ``arrival_time``: ``time.monotonic()`` when the handler got it (default: now).

        Raises:
            APIError (404), PromptError / SamplingParamsError / ContextLengthExceededError /
            DuplicateRequestError (400), EngineRequestError (400/429), EngineDeadError (503).
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        model = self.model_names.resolve(request.model)
        self.engine.check_available()
        params = request.sampling_params(self.engine.default_sampling_params)
        keep = request.truncation(self.engine.max_model_len)
        plan = self.tools.plan(request.template_tools(), request.tool_choice, request.parallel_tool_calls)
        if plan.constraint is not None:
            if params.structured_outputs is not None:
                raise SamplingParamsError(f"tool_choice {plan.mode!r} constrains the output; it cannot be "
                                          "combined with response_format or structured_outputs", "tool_choice")
            params = params.clone(structured_outputs=plan.constraint)
        await check_constraint(params, "tools" if plan.constraint is not None else request.constraint_param)
        check_queue_room(self.engine, 1, params.n)
        request_id = request_id_for("chatcmpl", request.request_id)
        kind = "delta" if request.stream else "cumulative"
        with self.engine.admitted(params.n):
            text, ids = await self.engine.run_in_tokenizer(self.render, request)
            if keep is not None and len(ids) > keep:  # vLLM's truncate_prompt_tokens: the last ``keep`` ids
                text, ids = None, ids[-keep:]
            check_context(self.engine.max_model_len, len(ids), params.max_tokens, "messages")
            streams = await open_streams(self.engine, request_id, [(text, ids)], params, kind, arrival,
                                         request.request_id)
        created = int(time.time())
        if request.stream:
            return event_stream(self._stream(request, request_id, created, model, streams[0], params, plan))
        (out,) = await final_outputs(streams)
        choices = [self._choice(request, c, params, plan) for c in sorted(out.outputs, key=lambda c: c.index)]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = UsageInfo.of(len(ids), completion_tokens, out.num_cached_tokens)
        response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                          usage=usage, kv_transfer_params=out.kv_transfer_params,
                                          prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
                                          prompt_token_ids=ids if request.return_token_ids else None)
        return JSONResponse(response.model_dump())

    def _logprobs(self, request: ChatCompletionRequest, c: CompletionOutput, params: SamplingParams) -> Any:
        if params.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, c.token_ids, c.logprobs or [], params.logprobs,
                             bool(request.return_tokens_as_token_ids))

    def _choice(self, request: ChatCompletionRequest, c: CompletionOutput, params: SamplingParams,
                plan: ToolPlan) -> ChatChoice:
        content, calls = extract_calls(plan, c.text)
        message = ChatResponseMessage(content=content, tool_calls=[call.to_openai() for call in calls])
        return ChatChoice(index=c.index, message=message, logprobs=self._logprobs(request, c, params),
                          finish_reason=finish_reason(plan, calls, c.finish_reason), stop_reason=c.stop_reason,
                          token_ids=list(c.token_ids) if request.return_token_ids else None)

    def _chunk(self, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
               include_usage: bool, usage: UsageInfo | None = None, prompt_token_ids: list[int] | None = None
               ) -> str:
        """One ``chat.completion.chunk`` event; ``prompt_token_ids`` (vLLM's return_token_ids) goes on the
        stream's first chunk."""
        chunk: dict[str, Any] = {
            "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices,
        }
        if prompt_token_ids is not None:
            chunk["prompt_token_ids"] = prompt_token_ids
        if include_usage:
            chunk["usage"] = None if usage is None else usage.model_dump()
        return sse(chunk)

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
        stream: RequestStream, params: SamplingParams, plan: ToolPlan,
    ) -> AsyncIterator[str]:
        include_usage = request.include_usage
        completion_tokens = cached_tokens = 0
        n_prompt = len(stream.prompt_token_ids)
        choice_tokens = [0] * params.n  # per choice, for continuous_usage_stats
        splitters = [ToolCallStream(plan) for _ in range(params.n)]

        def usage_of(index: int) -> UsageInfo | None:
            """The usage a chunk of choice ``index`` carries: only with vLLM's continuous_usage_stats."""
            return UsageInfo.of(n_prompt, choice_tokens[index], cached_tokens) if request.continuous_usage else None

        try:
            for index in range(params.n):
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                first_ids = stream.prompt_token_ids if request.return_token_ids and index == 0 else None
                yield self._chunk(request_id, created, model, [role], include_usage, usage_of(index), first_ids)
            async for out in stream:
                cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    choice_tokens[c.index] += len(c.token_ids)
                    logprobs = self._logprobs(request, c, params)
                    # NOTE: one chunk per step with new tokens, even with empty text (as vLLM does).
                    if not c.token_ids and not c.text and c.finish_reason is None:
                        continue
                    text, reason = splitters[c.index].feed(c.text), c.finish_reason
                    delta: dict[str, Any] = {"content": text} if text else {}
                    if reason is not None:
                        rest, calls = splitters[c.index].finish()
                        if calls:  # NOTE: the calls in one chunk, then the finish chunk (as OpenAI sends them)
                            call_delta = {"content": text + rest} if text + rest else {}
                            call_choice = {"index": c.index, "delta": {**call_delta, "tool_calls": calls},
                                           "logprobs": None, "finish_reason": None}
                            yield self._chunk(request_id, created, model, [call_choice], include_usage,
                                              usage_of(c.index))
                            text, rest = "", ""
                        delta = {"content": text + rest} if text + rest else {}
                        reason = finish_reason(plan, calls, reason)
                    choice = {"index": c.index, "delta": delta,
                              "logprobs": None if logprobs is None else logprobs.model_dump(),
                              "finish_reason": reason}
                    if reason is not None:  # NOTE: vLLM's field, on the chunk that ends the choice (as vLLM sends it)
                        choice["stop_reason"] = c.stop_reason
                    if request.return_token_ids:  # vLLM's: the ids this step added
                        choice["token_ids"] = list(c.token_ids)
                    yield self._chunk(request_id, created, model, [choice], include_usage, usage_of(c.index))
            if include_usage:
                usage = UsageInfo.of(n_prompt, completion_tokens, cached_tokens)
                yield self._chunk(request_id, created, model, [], include_usage, usage)
        except (EngineDeadError, EngineRequestError) as e:
            yield stream_error(e)
        finally:
            stream.abort()
        yield DONE

