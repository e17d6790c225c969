"""Sampling parameters of one request, with OpenAI and vLLM field names and semantics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Semantics follow vLLM's ``SamplingParams`` (and the OpenAI API where it names a field):

    - ``temperature`` 0 means greedy (argmax); ``top_k`` 0 or -1 disables top-k; ``top_p`` 1.0 and
      ``min_p`` 0.0 disable nucleus and min-p filtering.
    - ``repetition_penalty`` (>1 discourages repeats, CTRL paper, Keskar et al. 2019) applies to prompt
      and output tokens; ``presence_penalty`` and ``frequency_penalty`` (OpenAI) to output tokens only.
    - ``seed`` makes the sample reproducible whatever else runs in the batch (a per-request generator).
    - ``max_tokens`` None means "up to the model's context length"; ``min_tokens`` suppresses EOS and
      ``stop_token_ids`` until that many tokens have been generated.
    - ``logprobs`` N returns the sampled token's log-probability plus the N most likely tokens per
      position (log-softmax of the raw model logits, as vLLM does by default).
    - ``stop`` strings are cut from the text (unless ``include_stop_str_in_output``).

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
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
             f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
             f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty"),
            (self.seed is None or isinstance(self.seed, int), "seed", "seed must be an integer"),
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
