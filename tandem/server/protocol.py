"""OpenAI request schemas (pydantic), following the OpenAI API reference (responses: ``protocol_responses.py``).

Requests accept the OpenAI fields plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``request_id``, ``prompt_logprobs``,
``structured_outputs``, ``return_tokens_as_token_ids``, ``priority``, ``truncate_prompt_tokens``, and on chat
``chat_template_kwargs``: extra chat-template variables, e.g. Qwen3's ``enable_thinking``); unknown fields are
ignored, as OpenAI and vLLM do. Structured output comes from OpenAI's ``response_format`` (``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) on both endpoints. Fields that Tandem knows but cannot honour (``logit_bias``, ``suffix``,
``best_of``, legacy ``functions``, vLLM's older ``guided_*`` fields, ``cache_salt``, ``prompt_embeds``,
``vllm_xargs``, beam search, and on chat vLLM's
``chat_template``, ``documents``, ``continue_final_message`` and ``echo``) are refused with a 400 naming the
field instead of being silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator
from pydantic_core import PydanticCustomError

from tandem.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutputsParams
from tandem.server.protocol_tools import ResponseFormat, ToolCallParam, ToolParam

# Integer bounds, checked before anything reaches msgpack (64-bit) or torch. Lower bounds of n,
# max_tokens and min_tokens are SamplingParams' (its messages); these add what keeps values encodable.
MAX_N = 128  # OpenAI's cap on n; vLLM has none, but n engine requests per prompt must stay bounded
# NOTE: the full signed 64-bit range (torch.Generator and msgpack take int64). Child i of an n-sample
# request is seeded seed + i wrapped into that range (SamplingParams.child_seed), so 2**63 - 1 with n = 2
# gives the children 2**63 - 1 and -2**63.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (legacy OpenAI API, vLLM)
INT32_MAX = 2**31 - 1  # token counts, token ids and top_k are far below it
# A token id of the model: the document's maximum (vocabulary size - 1) is filled in by openapi.py.
VOCAB_ID = "x-tandem-token-id"
TokenId = Annotated[int, Strict(), Field(json_schema_extra={"minimum": 0, VOCAB_ID: True})]  # NOTE: Strict
# rejects true/false (lax mode reads them as 1/0)
BoundedTokenId = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
TokenCount = Annotated[int, Field(le=INT32_MAX)]
NonEmptyStr = Annotated[str, Field(json_schema_extra={"minLength": 1})]
TokenIds = Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]


def checked(default: Any = None, **bounds: Any) -> Any:
    """A field whose JSON Schema states ``bounds`` (``minimum``, ``exclusiveMinimum``, ``maximum``,
    ``minItems``...) that the server enforces itself (SamplingParams, the prompt checks), with its own
    messages: pydantic does not check them again."""
    return Field(default, json_schema_extra=bounds)
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def _first_lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate (as ``U+D800``) in any string inside ``value``, or None.

    JSON may escape UTF-16 halves (``"\\ud800"``) that no UTF-8 text can hold; tokenizers, msgpack
    and the JSON encoder of the reply all fail on them, so they are refused at the door.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item.isascii():
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"U+{ord(item[e.start]):04X}"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


class OpenAIModel(BaseModel):
    """Ignores unknown fields; refuses NaN/Infinity floats and strings that are not valid Unicode."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        surrogate = _first_lone_surrogate(value)
        if surrogate is not None:
            raise PydanticCustomError(
                "invalid_unicode", "the string is not valid Unicode (lone surrogate {char})", {"char": surrogate})
        return value


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions. ``unsupported``: the fields Tandem knows and
    does not honour; a value other than null or empty is a 400 naming the field."""

    unsupported: ClassVar[tuple[str, ...]] = (
        "logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "allowed_token_ids", "bad_words", "logits_processors", "cache_salt", "prompt_embeds", "vllm_xargs")

    model: str | None = None
    n: Annotated[int, Field(le=MAX_N)] = checked(1, minimum=1)
    temperature: float | None = checked(minimum=0)
    top_p: float | None = checked(exclusiveMinimum=0, maximum=1)
    top_k: TokenCount | None = checked(minimum=-1)
    min_p: float | None = checked(minimum=0, maximum=1)
    presence_penalty: float | None = checked(minimum=-2, maximum=2)
    frequency_penalty: float | None = checked(minimum=-2, maximum=2)
    repetition_penalty: float | None = checked(exclusiveMinimum=0)
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[BoundedTokenId] | None = None
    max_tokens: TokenCount | None = checked(minimum=1)
    min_tokens: TokenCount = checked(0, minimum=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's disaggregated prefill protocol (tandem/disagg/connector.py): passed to the engine as is.
    kv_transfer_params: dict[str, Any] | None = None
    # NOTE: known fields Tandem does not honour yet: a non-null value is refused (400, param = the field).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    prompt_logprobs: NumLogprobs | None = None
    # vLLM's: logprobs show each token as "token_id:{id}" (tandem/server/logprobs.py)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None  # vLLM's: prompt_token_ids and token_ids in the answer (not with echo)
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    cache_salt: Any = None
    prompt_embeds: Any = None
    vllm_xargs: Any = None
    # vLLM's admission priority (lower first) under --scheduling-policy priority; other policies refuse a
    # non-zero value (in the engine core, which knows its policy), as vLLM does.
    priority: Annotated[int, Strict(), Field(ge=SEED_MIN, le=SEED_MAX)] = 0
    # vLLM's: keep only the last k prompt tokens (-1: the context length); ``truncation`` checks it.
    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=-1, le=INT32_MAX)] | None = None
    # vLLM's beam search: only its defaults are accepted (Tandem samples; it has no beam search).
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("kv_transfer_params")
    @classmethod
    def _encodable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The engine gets ``kv_transfer_params`` as is over msgpack, which holds integers in
        [-2**63, 2**64 - 1] only (a wider one was a 500 when the request was sent)."""
        try:
            msgspec.msgpack.encode(value)
        except OverflowError as e:
            raise PydanticCustomError("int_range", "{error}", {"error": str(e)}) from None
        return value

    def refuse_unsupported(self) -> None:
        """Raises: SamplingParamsError for the first of ``unsupported`` given a value (not null or empty)."""
        for name in self.unsupported:
            if getattr(self, name) not in (None, "", {}, []):
                raise SamplingParamsError(f"{name} is not supported", name)
        if self.use_beam_search:
            raise SamplingParamsError("use_beam_search is not supported (Tandem has no beam search)", "use_beam_search")
        if self.length_penalty != 1.0:
            raise SamplingParamsError("length_penalty is not supported (it applies to beam search only)",
                                      "length_penalty")

    def truncation(self, max_model_len: int) -> int | None:
        """How many prompt tokens to keep, the last ones (vLLM's ``truncate_prompt_tokens``; -1 means
        ``max_model_len``), or None to keep them all.

        Raises:
            SamplingParamsError: 0, or more than ``max_model_len`` (vLLM's message).
        """
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        if keep == 0:
            raise SamplingParamsError("truncate_prompt_tokens must be -1 (the context length) or at least 1, got 0",
                                      "truncate_prompt_tokens")
        if keep > max_model_len:
            raise SamplingParamsError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                                      f"({max_model_len}). Please, select a smaller truncation size.",
                                      "truncate_prompt_tokens")
        return max_model_len if keep == -1 else keep

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str]:
        """The request's constraint and the field it came from (``response_format`` or ``structured_outputs``).

        Raises:
            SamplingParamsError: both fields set, or an invalid constraint (before the grammar check).
        """
        fmt = self.response_format.structured_outputs() if self.response_format is not None else None
        if self.structured_outputs is None:
            return fmt, "response_format"
        if fmt is not None:
            raise SamplingParamsError("give response_format or structured_outputs, not both", "structured_outputs")
        return StructuredOutputsParams.from_dict(self.structured_outputs), "structured_outputs"

    @property
    def constraint_param(self) -> str:
        """The field the request's constraint came from, for errors: ``structured_outputs`` or
        ``response_format``."""
        return "response_format" if self.structured_outputs is None else "structured_outputs"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``): usage on every chunk, the prompt's
        tokens and those of the chunk's choice so far."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def to_sampling_params(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams from this request; absent fields take the model's defaults
        (generation_config.json), as vLLM does. A constraint is parsed, not yet checked by llguidance
        (the handler does that off the event loop: ``serving_common.check_constraint``).

        Raises:
            SamplingParamsError: an out-of-range or unsupported value (the server answers 400).
        """
        self.refuse_unsupported()
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options is only allowed when stream is true", "stream_options")
        if self.return_token_ids and getattr(self, "echo", False):
            raise SamplingParamsError("return_token_ids is not supported with echo", "return_token_ids")
        changes: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "max_tokens": max_tokens, "min_tokens": self.min_tokens,
            "stop": [] if self.stop is None else self.stop, "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos, "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0, "kv_transfer_params": self.kv_transfer_params,
            "priority": self.priority,
        }
        structured, _ = self.structured_outputs_params()
        if structured is not None:
            # NOTE: llguidance's check (check_grammar) runs in the handler, off the event loop.
            changes["structured_outputs"] = structured
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
        return defaults.clone(**changes)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``max_tokens`` absent: 16 (the legacy OpenAI API's default and vLLM's), checked
    against the context like a given value; null: up to the context limit (vLLM); 0 (with ``echo``) returns
    the prompt alone, with its logprobs when ``logprobs`` is set (the legacy OpenAI API, vLLM)."""

    unsupported: ClassVar[tuple[str, ...]] = (*SamplingRequest.unsupported, "suffix")
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(json_schema_extra={"minItems": 1})] | TokenIds | \
        Annotated[list[TokenIds], Field(json_schema_extra={"minItems": 1})]
    # NOTE: 0 only with echo (a 400 otherwise). The default applies only when the field is absent: an
    # explicit null keeps meaning "up to the context limit", as in vLLM.
    max_tokens: TokenCount | None = checked(DEFAULT_COMPLETION_MAX_TOKENS, minimum=0)
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """Raises: SamplingParamsError on unsupported combinations or values."""
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamsError("best_of must be absent or equal to n", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise SamplingParamsError("max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                                      "max_tokens")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        if self.prompt_only and prompt_logprobs is None:
            prompt_logprobs = 0  # NOTE: an engine request with max_tokens 0 runs for its prompt logprobs
        return self.to_sampling_params(defaults, self.max_tokens, self.logprobs, prompt_logprobs)

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt (and its logprobs) alone."""
        return self.echo and self.max_tokens == 0


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    def to_template_message(self, index: int) -> dict[str, Any]:
        """``{"role", "content"}`` (+ ``tool_calls``, ``tool_call_id``, ``name``) for the chat template;
        text parts are joined with newlines. An assistant message with tool calls may have no content.

        Raises:
            SamplingParamsError: a non-text content part, null content without tool calls, tool calls
                outside an assistant message (param ``messages.<i>...``).
        """
        param = f"messages.{index}.content"
        if self.tool_calls and self.role != "assistant":
            raise SamplingParamsError("only assistant messages have tool_calls", f"messages.{index}.tool_calls")
        if self.content is None:
            if not self.tool_calls:
                raise SamplingParamsError("content must not be null", param)
            # NOTE: "" rather than None: transformers drops None fields, and templates that read
            # message.content (SmolLM2's, Llama's) then fail on an assistant turn holding only tool calls.
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise SamplingParamsError(
                        f"only text content parts are supported, got type {part.get('type')!r}", param)
                texts.append(part["text"])
            text = "\n".join(texts)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


# Parameters of transformers' apply_chat_template (and the names Tandem passes itself): not template variables.
_CHAT_TEMPLATE_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "kwargs"})


def template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` checked: a key that is a parameter of transformers' ``apply_chat_template``
    (``tokenize``, ``add_generation_prompt``, ``tools``, ...) would change how Tandem renders, not the
    template's variables, so it is refused, as is a key that is not a Python identifier.

    Raises: PydanticCustomError (a 400 on ``chat_template_kwargs``)."""
    for key in value or {}:
        if key in _CHAT_TEMPLATE_PARAMETERS or not key.isidentifier():
            raise PydanticCustomError("template_kwarg", "{detail}", {"detail": f"may not set {key!r}"})
    return value


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    unsupported: ClassVar[tuple[str, ...]] = (*SamplingRequest.unsupported, "functions", "function_call",
                                              "prediction", "audio", "chat_template", "documents")
    # NOTE: vLLM's boolean extras Tandem does not honour: true is refused (400), false is the default.
    unsupported_flags: ClassVar[tuple[str, ...]] = ("continue_final_message", "echo")
    messages: list[ChatMessage] = checked(..., minItems=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    max_completion_tokens: TokenCount | None = checked(minimum=1)
    tools: list[ToolParam] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: Any = None
    documents: Any = None
    continue_final_message: bool = False
    echo: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(value)

    def refuse_unsupported(self) -> None:
        """Raises: SamplingParamsError for the first of ``unsupported`` given a value, or of
        ``unsupported_flags`` set to true."""
        super().refuse_unsupported()
        for name in self.unsupported_flags:
            if getattr(self, name):
                raise SamplingParamsError(f"{name} is not supported", name)

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``; errors name the one given.

        Raises: SamplingParamsError on unsupported fields or out-of-range values."""
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        name = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = getattr(self, name)
        try:
            if max_tokens == 0:  # NOTE: SamplingParams takes 0 with prompt_logprobs (the prompt alone); chat does not
                raise SamplingParamsError("max_tokens must be at least 1, got 0", "max_tokens")
            return self.to_sampling_params(defaults, max_tokens, logprobs)
        except SamplingParamsError as e:
            if e.param != "max_tokens" or name == "max_tokens":
                raise
            raise SamplingParamsError(str(e).replace("max_tokens", name), name) from None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_message(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as plain dicts for the chat template (None without tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TokenizeRequest(OpenAIModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``, exactly one of them."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = checked(minItems=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat completions: the same prompt, the same count

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(value)


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
