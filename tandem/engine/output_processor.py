"""Turns the engine core's token outputs into user-facing ``RequestOutput``s (vLLM v1 ``OutputProcessor``).

Per engine request (a *child*: one of the ``n`` completions of a prompt) it keeps an incremental
detokenizer, the token ids, logprobs (with ``decoded_token`` filled: the sampled token's text in context,
the alternatives' text alone, see ``_add_logprobs``) and the finish state; children of
one prompt (the *parent*) are reported together in one ``RequestOutput`` whose ``outputs`` are sorted
by index. Stop strings are detected here, on text: a match finishes the child and its id is returned
in ``reqs_to_abort`` so the caller aborts it in the engine core.

Output kinds (``add_request(..., output_kind=...)``):
  - ``"cumulative"`` (default, offline API): each ``CompletionOutput`` holds everything so far;
  - ``"delta"`` (SSE streaming): only the text/token ids/logprobs new since the previous output of
    that child, and only children that changed appear;
  - ``"final"``: one ``RequestOutput`` when the whole prompt is finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from transformers import PreTrainedTokenizerBase

from tandem.engine.detokenizer import IncrementalDetokenizer, StopStrings, standalone_token_text
from tandem.outputs import CompletionOutput, EngineCoreOutput, PositionLogprobs, PromptLogprobs, RequestOutput
from tandem.sampling_params import SamplingParams

OutputKind = Literal["cumulative", "delta", "final"]
_OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclass
class ProcessedOutputs:
    """Result of one ``process_outputs`` call."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Child (engine) request ids whose stop string matched: the engine core must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


class _ChildState:
    """One completion: detokenizer, token ids, logprobs, finish state, and what was already sent."""

    def __init__(self, request_id: str, parent: _ParentState, index: int, params: SamplingParams,
                 tokenizer: PreTrainedTokenizerBase, token_text: dict[int, str]) -> None:
        self.request_id = request_id
        self.parent = parent
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.token_text = token_text  # shared cache: token id -> decoded text of that token alone
        if parent.stop_strings is None or parent.stop_strings.stops != params.stop:
            # NOTE: prepared once per prompt: 64 strings of 256 characters take milliseconds to prepare.
            parent.stop_strings = StopStrings(params.stop)
        self.detokenizer = IncrementalDetokenizer(tokenizer, params, parent.prompt_token_ids, parent.stop_strings)
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.changed = False
        self.sent_text = 0  # characters of text already sent (delta mode)
        self.sent_tokens = 0  # token ids (and logprob positions) already sent (delta mode)
        self.num_draft_tokens = 0  # speculative decoding: drafts verified / accepted so far
        self.num_accepted_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> str | None:
        """Add one core output; returns the stop string if one matched. Changes all fields above."""
        self.num_draft_tokens, self.num_accepted_tokens = output.num_draft_tokens, output.num_accepted_tokens
        stop_terminated = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)
        stop_string = self.detokenizer.update(
            output.new_token_ids, stop_terminated, finished=output.finish_reason is not None
        )
        # Tokens after the one completing a stop string (a multi-token speculative step) are dropped.
        kept = len(output.new_token_ids) - (self.detokenizer.num_new_tokens_after_stop if stop_string else 0)
        self.token_ids.extend(output.new_token_ids[:kept])
        if self.logprobs is not None and output.new_logprobs:
            self._add_logprobs(output.new_token_ids[:kept], output.new_logprobs[:kept])
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        if output.prompt_logprobs is not None and self.parent.prompt_logprobs is None:
            self.parent.prompt_logprobs = output.prompt_logprobs
            for position in output.prompt_logprobs:
                for candidate, logprob in (position or {}).items():
                    logprob.decoded_token = self._token_text(candidate)
        self.changed = True
        return stop_string

    def _add_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs]) -> None:
        """Record the positions of ``token_ids`` (just detokenized) and fill their ``decoded_token``.

        The sampled token gets the text it added to the completion in context (as vLLM v0), so the
        tokens' texts join into the text (before a stop-string cut) and keep SentencePiece spaces; a
        token that only starts a multi-byte character gets "" and the one completing it the character.
        A left-out EOS/stop token and the alternatives get their text alone (``standalone_token_text``).
        """
        # NOTE: fills decoded_token on the core's Logprob objects in place; they are not reused.
        assert self.logprobs is not None and self.cumulative_logprob is not None
        in_context = self.detokenizer.new_token_texts
        for i, (token_id, position) in enumerate(zip(token_ids, positions, strict=True)):
            for candidate, logprob in position.items():
                logprob.decoded_token = self._token_text(candidate)
            if i < len(in_context):
                position[token_id].decoded_token = in_context[i]
            self.cumulative_logprob += position[token_id].logprob
            self.logprobs.append(position)

    def _token_text(self, token_id: int) -> str:
        text = self.token_text.get(token_id)
        if text is None:
            text = standalone_token_text(self.tokenizer, token_id)
            self.token_text[token_id] = text
        return text

    def completion(self, delta: bool) -> CompletionOutput:
        """This child's ``CompletionOutput``; ``delta`` sends only what is new and advances the marks."""
        text = self.detokenizer.output_text
        end = self.detokenizer.releasable_length(self.finished)
        start_text, start_tokens = (self.sent_text, self.sent_tokens) if delta else (0, 0)
        if delta:
            self.sent_text, self.sent_tokens = max(self.sent_text, end), len(self.token_ids)
        self.changed = False
        return CompletionOutput(
            index=self.index,
            text=text[start_text:end],
            token_ids=self.token_ids[start_tokens:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start_tokens:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )


class _ParentState:
    """One prompt and its ``n`` children (by index)."""

    def __init__(self, parent_id: str, n: int, prompt: str | None, prompt_token_ids: list[int],
                 output_kind: OutputKind) -> None:
        self.parent_id = parent_id
        self.n = n
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.children: dict[int, _ChildState] = {}
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None  # from the first child that reports them
        self.prompt_logprobs_sent = False  # delta mode: they go out once
        self.kv_transfer_params: dict | None = None
        self.stop_strings: StopStrings | None = None  # the children's stop strings, prepared (read-only)

    @property
    def finished(self) -> bool:
        return len(self.children) == self.n and all(c.finished for c in self.children.values())

    def make_output(self) -> RequestOutput | None:
        """The ``RequestOutput`` for this step, or None (``"final"`` kind before the end)."""
        finished = self.finished
        if self.output_kind == "final" and not finished:
            return None
        delta = self.output_kind == "delta"
        children = sorted(self.children.values(), key=lambda c: c.index)
        outputs = [c.completion(delta) for c in children if c.changed or not delta]
        prompt_logprobs = None if delta and self.prompt_logprobs_sent else self.prompt_logprobs
        self.prompt_logprobs_sent = self.prompt_logprobs is not None
        return RequestOutput(
            request_id=self.parent_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=self.kv_transfer_params,
        )


class OutputProcessor:
    """Detokenizes, applies stop strings and aggregates ``n`` children, for all live requests.

    Holds per-request state from ``add_request`` until the prompt's last output (or ``abort_request``).
    Runs in the front-end process (never the engine core), so detokenization does not hold the core's GIL.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, _ChildState] = {}
        self._token_text: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        n: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = "cumulative",
    ) -> None:
        """Start tracking engine request ``request_id``, completion ``index`` of ``n`` for ``parent_id``.

        The caller splits an ``n > 1`` prompt into ``n`` engine requests (ids ``f"{index}_{parent_id}"``)
        and adds each one here; the first call for a parent fixes its prompt, ``n`` and output kind.

        Raises:
            ValueError: duplicate ``request_id`` or ``index``, ``index`` not in ``[0, n)``, an unknown
                ``output_kind``, or ``n``/``output_kind`` different from the parent's first child.
        """
        if output_kind not in _OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {_OUTPUT_KINDS}, got {output_kind!r}")
        if request_id in self._children:
            raise ValueError(f"request {request_id!r} is already being processed")
        if not 0 <= index < n:
            raise ValueError(f"index {index} out of range for n={n}")
        parent = self._parents.get(parent_id)
        if parent is None:
            parent = _ParentState(parent_id, n, prompt, list(prompt_token_ids), output_kind)
        elif parent.n != n or parent.output_kind != output_kind:
            raise ValueError(f"request {request_id!r} differs from parent {parent_id!r} in n or output_kind")
        elif index in parent.children:
            raise ValueError(f"parent {parent_id!r} already has a child with index {index}")
        child = _ChildState(request_id, parent, index, params, self.tokenizer, self._token_text)
        parent.children[index] = child
        self._parents[parent_id] = parent
        self._children[request_id] = child

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step of core outputs.

        Outputs for unknown ids (aborted) or children already finished by a stop string are ignored.
        Returns one ``RequestOutput`` per parent that changed (none for ``"final"`` parents still
        running), in order of first appearance, and the child ids to abort in the core.
        Changes: per-request state; parents whose output is ``finished`` are forgotten.
        """
        processed = ProcessedOutputs()
        changed: dict[str, _ParentState] = {}
        for output in outputs:
            child = self._children.get(output.request_id)
            if child is None or child.finished:
                continue
            stop_string = child.update(output)
            if stop_string is not None and output.finish_reason is None:
                processed.reqs_to_abort.append(child.request_id)
            parent = child.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
            if output.kv_transfer_params is not None:
                parent.kv_transfer_params = output.kv_transfer_params
            changed[parent.parent_id] = parent
        for parent in changed.values():
            request_output = parent.make_output()
            if request_output is not None:
                processed.request_outputs.append(request_output)
            if parent.finished:
                self._forget(parent)
        return processed

    def abort_request(self, request_id: str) -> list[str]:
        """Drop a prompt, given its parent id or any of its child ids.

        Returns the child (engine) request ids that were dropped and had not finished, so the caller
        can abort them in the core; [] if the id is unknown. Changes: forgets the parent and children.
        """
        parent = self._parents.get(request_id)
        if parent is None:
            child = self._children.get(request_id)
            if child is None:
                return []
            parent = child.parent
        self._forget(parent)
        children = sorted(parent.children.values(), key=lambda c: c.index)
        return [c.request_id for c in children if not c.finished]

    def has_unfinished_requests(self) -> bool:
        """True while any added prompt has not produced its finished output."""
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        """Number of prompts (parents) still tracked."""
        return len(self._parents)

    def _forget(self, parent: _ParentState) -> None:
        self._parents.pop(parent.parent_id, None)
        for child in parent.children.values():
            self._children.pop(child.request_id, None)
