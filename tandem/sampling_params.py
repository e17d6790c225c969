"""Sampling parameters of one request, with OpenAI and vLLM field names and semantics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

_GREEDY_EPS = 1e-5
# A seed must fit torch.Generator.manual_seed (int64); n > 1 children use seed + i, wrapped (see child_seed).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's cap; vLLM's default max_logprobs is 20)
# NOTE: stop strings are matched in the front end's event loop for every decoded token of the request, so
# their number and length are bounded (OpenAI allows 4 strings, vLLM sets no bound): unbounded, two requests
# with 10,000 strings each held a concurrent 20-token request for 28 s.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 256  # characters


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def child_seed(seed: int, index: int) -> int:
    """The seed of child ``index`` of an ``n > 1`` request: seed + index, wrapped into the int64 range."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


@dataclass
class StructuredOutputsParams:
    """A constraint on the completion's text (vLLM's ``StructuredOutputsParams``, same field names).

    Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (the
    completion is one of these strings), ``grammar`` (Lark or GBNF) or ``json_object`` (any JSON
    object) is set. ``disable_any_whitespace`` (vLLM) forbids whitespace between JSON tokens; by
    default one space, or a newline and up to 16 spaces or tabs, may separate them (pretty-printed
    JSON fits, and a weak model cannot pad with whitespace until ``max_tokens``). The grammar engine
    (llguidance) masks the logits so that only tokens keeping the text a prefix of the language can
    be sampled; generation stops when the text is complete. A schema keyword it cannot honour is
    refused at the edge (never relaxed).

    Raises:
        SamplingParamsError: none or several constraints, or a value of the wrong type.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.disable_any_whitespace is None:  # NOTE: a client's null means the default
            self.disable_any_whitespace = False
        # NOTE: every field checked here: the engine core's msgspec decoder is strict, and a request
        # of the wrong type reaching it (e.g. disable_any_whitespace "yes") stopped the core.
        checks = {"json": (str, dict), "regex": str, "grammar": str, "choice": list, "json_object": bool,
                  "disable_any_whitespace": bool}
        for name, types in checks.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                raise SamplingParamsError(f"structured_outputs.{name} has the wrong type", f"structured_outputs.{name}")
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(kinds) or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                      "structured_outputs.choice")

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        """The constraint of a request's ``structured_outputs`` object.

        Raises:
            SamplingParamsError: not an object, or a field this class does not have (named, with the
                known ones), or what ``__post_init__`` refuses.
        """
        if not isinstance(value, dict):
            raise SamplingParamsError("structured_outputs must be an object", "structured_outputs")
        names = [f.name for f in fields(cls)]
        unknown = [key for key in value if key not in names]
        if unknown:
            raise SamplingParamsError(f"structured_outputs has no field {unknown[0]!r}; its fields are "
                                      f"{', '.join(names)}", "structured_outputs")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Semantics follow vLLM's ``SamplingParams`` (and the OpenAI API where it names a field):

    - ``temperature`` 0 means greedy (argmax); ``top_k`` 0 or -1 disables top-k; ``top_p`` 1.0 and
      ``min_p`` 0.0 disable nucleus and min-p filtering.
    - ``repetition_penalty`` (>1 discourages repeats, CTRL paper, Keskar et al. 2019) applies to prompt
      and output tokens; ``presence_penalty`` and ``frequency_penalty`` (OpenAI) to output tokens only.
    - ``seed`` makes the sample reproducible whatever else runs in the batch (a per-request generator).
    - ``max_tokens`` None means "up to the model's context length"; 0 (only with ``prompt_logprobs``)
      runs the prompt alone: the request ends after its prefill with no output token, and its prompt
      may fill the whole context. ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that many
      tokens have been generated.
    - ``logprobs`` N returns the sampled token's log-probability plus the N most likely tokens per
      position (log-softmax of the raw model logits, as vLLM does by default).
    - ``prompt_logprobs`` N (vLLM) returns, for every prompt token after the first, its log-probability
      given the tokens before it plus the N most likely tokens there (``RequestOutput.prompt_logprobs``;
      position 0 is None). Such a request skips the prefix cache until its prompt is computed.
    - ``stop`` strings are cut from the text (unless ``include_stop_str_in_output``); at most
      ``MAX_STOP_STRINGS`` (64) of at most ``MAX_STOP_STRING_LENGTH`` (256) characters each.
    - ``priority`` orders admission when the scheduler's policy is "priority": lower values first,
      ties by arrival time (vLLM semantics); ignored under "fcfs".
    - ``structured_outputs`` constrains the text to a JSON schema, regex, choice or grammar
      (``StructuredOutputsParams``); a request waits for its grammar to compile before it runs.
    - ``speculative`` (Tandem only) False runs this request without drafts when the engine speculates;
      the output distribution is the same either way, only the speed differs.
    - ``kv_transfer_params`` (vLLM's disaggregated prefill protocol, ``tandem/disagg``): a JSON object
      with ``do_remote_decode`` (this is a prefill leg: keep the KV for a decode server) or
      ``do_remote_prefill`` and the ``remote_*`` fields a prefill leg answered (pull the KV).

    Raises:
        ValueError: on any out-of-range value (checked in ``__post_init__``); the server maps it to
            an OpenAI 400 error.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    speculative: bool = True  # Tandem: False opts this request out of the engine's speculative decoding
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _check_types(self) -> None:
        """Rejects wrong types (bool is not an int here; NaN and infinities are not numbers here)."""
        ints = ("n", "top_k", "min_tokens", "priority")
        optional_ints = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in ints + optional_ints:
            value = getattr(self, name)
            if value is None and name in optional_ints:
                continue
            if not _is_int(value):
                raise SamplingParamsError(f"{name} must be an integer, got {value!r}", name)
        for name in floats:
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise SamplingParamsError(f"{name} must be a finite number, got {value!r}", name)
        if not all(_is_int(t) and 0 <= t < 2**31 for t in self.stop_token_ids):
            raise SamplingParamsError(
                f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}", "stop_token_ids"
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop must be a string or a list of strings", "stop")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise SamplingParamsError("kv_transfer_params must be an object", "kv_transfer_params")

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k",
             f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or 1 <= self.max_tokens < 2**31
             or (self.max_tokens == 0 and self.prompt_logprobs is not None), "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0 <= self.min_tokens < 2**31, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             "logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(self.stop), "stop", "stop strings must be non-empty"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop",
             f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"),
            (all(len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop), "stop",
             f"a stop string may have at most {MAX_STOP_STRING_LENGTH} characters, got "
             f"{max(map(len, self.stop), default=0)}"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
             f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names the offending field (OpenAI error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
