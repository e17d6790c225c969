"""Incremental detokenization of one completion, with stop-string detection.

Token ids arrive a few at a time; the text must grow without ever showing half a UTF-8 character,
and must end equal to ``tokenizer.decode(output_ids, skip_special_tokens=...)``. The method is the
one of Hugging Face's ``TextStreamer`` and vLLM's ``detokenize_incrementally``: decode a short window
of recent ids twice (with and without the newest ones) and emit the difference, holding it back while
it ends in U+FFFD (an incomplete byte sequence, from byte-fallback or byte-level tokens). Decoding a
window rather than single tokens keeps context-dependent rules right (SentencePiece's leading space,
``Strip`` decoders, byte-fallback runs).

As in vLLM (``convert_prompt_ids_to_tokens``), the first window starts on the last few prompt tokens, so
the completion's text is what it adds to the decoded prompt: ``decode(prompt + output)[len(decode(prompt)):]``.
Without that context a SentencePiece tokenizer drops the first output token's space ("Lily went to the" ->
"park" instead of " park"), because its decoder strips the space that starts a decoded text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from tandem.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
_SPACE_MARKER = "\u2581"  # SentencePiece's "▁", which its decoders turn into a space
# Prompt tokens that start the first decoding window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET),
# and how far back the window may move so that it does not start inside a multi-byte character (the
# bound of vLLM's FastIncrementalDetokenizer prompt-suffix search).
PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 24


class IncrementalDetokenizer:
    """Text of one completion, grown token by token, cut at the first stop string.

    State: ``token_ids`` (a short tail of the prompt, then the ids detokenized so far), ``output_text``
    (complete characters only, cut at a matched stop string) and two offsets into ``token_ids``:
    ``prefix_offset`` starts the decoding window and ``read_offset`` marks the ids whose text is already
    shown (in the prompt or in ``output_text``). ``new_token_texts`` holds the text each id of the last
    ``update`` added (the in-context text of a token, which logprobs report).

    A prompt that ends inside a multi-byte character (its text ends in U+FFFD) has that character shown
    whole at the start of ``output_text`` once the output completes it (as vLLM's ``DecodeStream``-based
    detokenizer does). Known limit: a genuinely invalid byte sequence (a model emitting random byte
    tokens) can decode differently once later bytes join its run; valid UTF-8 always matches
    ``tokenizer.decode``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams,
                 prompt_token_ids: Sequence[int] = (), stop: StopStrings | None = None) -> None:
        """``stop``: ``params.stop`` prepared (``StopStrings``, read-only), shared by the children of one
        prompt; made here when None."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = stop if stop is not None else StopStrings(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.num_output_tokens = 0
        self._num_update_ids = 0
        # Ids of the last update that follow the token completing a matched stop string.
        self.num_new_tokens_after_stop = 0
        self.output_text = ""
        self.new_token_texts: list[str] = []
        self.token_ids = self._prompt_context(list(prompt_token_ids[-_MAX_PROMPT_CONTEXT_TOKENS:]))
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt tail that starts the first window: the last ``PROMPT_CONTEXT_TOKENS`` ids, extended
        back (up to ``_MAX_PROMPT_CONTEXT_TOKENS``) while its text starts with U+FFFD, i.e. inside a
        character, whose bytes would otherwise decode differently once joined by the output's."""
        start = max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS)
        floor = max(0, len(prompt_ids) - _MAX_PROMPT_CONTEXT_TOKENS)
        while start > floor and self._decode(prompt_ids[start:]).startswith(_REPLACEMENT_CHAR):
            start -= 1
        return prompt_ids[start:]

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool) -> str | None:
        """Detokenize ``new_token_ids`` and look for a stop string in the new text.

        Args:
            new_token_ids: ids sampled since the last call.
            stop_terminated: the last id is EOS or a stop token id; as in vLLM, its text is left out
                unless ``include_stop_str_in_output``.
            finished: the request ended; text held back for an incomplete character is released.
        Returns:
            The stop string that matched (``output_text`` is then cut at it), or None.
        Changes: appends to ``token_ids`` and ``output_text``; moves the offsets; sets
        ``new_token_texts`` to the text each detokenized id added (one entry per id of
        ``new_token_ids``, except a left-out stop id; text released at the finish goes to the last one).
        """
        self.num_output_tokens += len(new_token_ids)
        self._num_update_ids = len(new_token_ids)
        self.num_new_tokens_after_stop = 0
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        old_length = len(self.output_text)
        self.new_token_texts = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.new_token_texts.append(self._decode_next(final=False))
        self.output_text += "".join(self.new_token_texts)
        if finished:
            released = self._decode_next(final=True)
            self.output_text += released
            if self.new_token_texts:
                self.new_token_texts[-1] += released
        return self._check_stop(old_length)

    def releasable_length(self, finished: bool) -> int:
        """How many characters of ``output_text`` may be shown now.

        While unfinished, a suffix that could be the start of a stop string is held back (it is released
        once it cannot be, or at the end), so no part of a stop string is ever streamed. With
        ``include_stop_str_in_output`` nothing needs holding back.
        """
        if finished or self.include_stop_str_in_output or not self.stop:
            return len(self.output_text)
        return len(self.output_text) - self.stop.partial_length(self.output_text)

    def _decode(self, token_ids: list[int]) -> str:
        # NOTE: no clean_up_tokenization_spaces: it rewrites text across window edges (" ." -> "."),
        # which would break the prefix arithmetic; transformers skips it for BPE tokenizers anyway.
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_next(self, final: bool) -> str:
        """New complete text after the latest ids (``final``: also text ending in U+FFFD)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        shown = len(prefix_text)
        if not new_text.startswith(prefix_text):
            # NOTE: only when the prompt ends inside a character that the new bytes complete: its
            # U+FFFDs were never output, so the whole character is new text.
            complete = prefix_text.rstrip(_REPLACEMENT_CHAR)
            shown = len(complete) if new_text.startswith(complete) else shown
        if len(new_text) <= shown or (new_text.endswith(_REPLACEMENT_CHAR) and not final):
            # Nothing new yet, or the newest bytes do not complete a character: wait for more ids.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[shown:]

    def _check_stop(self, old_length: int) -> str | None:
        """Find the earliest stop string that ends in the text added after ``old_length``; cut there."""
        # NOTE: as in vLLM, stop strings are only looked for once more than min_tokens tokens exist,
        # and only in text that is new (or overlaps it), so a stop string inside the first
        # min_tokens tokens never ends the request.
        if not self.stop or len(self.output_text) == old_length or self.num_output_tokens <= self.min_tokens:
            return None
        found = self.stop.find(self.output_text, old_length)
        if found is None:
            return None
        index, stop = found
        self.num_new_tokens_after_stop = self._tokens_after(old_length, index + len(stop))
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def _tokens_after(self, old_length: int, stop_end: int) -> int:
        """How many of this update's ids come after the one whose text completes the stop string.

        NOTE: with speculative decoding one step brings several tokens; those after the stop string
        are dropped from the completion's token ids, so ids and usage match plain decoding.
        """
        reached = old_length
        for i, text in enumerate(self.new_token_texts):
            reached += len(text)
            if reached >= stop_end:
                return self._num_update_ids - (i + 1)
        return 0


class StopStrings:
    """The stop strings of one request, prepared once so that each check costs about what the new text costs.

    ``find`` runs one regular expression (the strings as alternatives, in order) over the new text plus
    the ``longest - 1`` characters before it; ``partial_length`` tries the suffixes of at most
    ``longest - 1`` characters against the hashes of all proper prefixes (a hit is confirmed against the
    strings). Before, each update called ``str.find`` per string and sliced every prefix of every string:
    10,000 strings made each token cost milliseconds in the front end's event loop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.longest = max(map(len, self.stops), default=0)
        # NOTE: re.compile caches by pattern text, so the n children of a request share one compiled pattern.
        self._pattern = re.compile("|".join(map(re.escape, self.stops))) if self.stops else None
        self._prefix_hashes = {hash(stop[:length]) for stop in self.stops for length in range(1, len(stop))}

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest occurrence of any stop string that overlaps ``text[new_from:]``.

        Text before ``new_from`` was already searched, so a match must end after it: the search starts
        ``longest - 1`` characters earlier. Ties at one position go to the stop listed first (as the
        regular expression's alternatives are tried).

        Returns:
            ``(start index in text, stop string)`` or None.
        """
        if self._pattern is None:
            return None
        pos = max(0, new_from - self.longest + 1)
        while (match := self._pattern.search(text, pos)) is not None:
            if match.end() > new_from:
                return match.start(), match.group()
            # NOTE: only when old text was not searched (the first min_tokens tokens): a string listed
            # earlier ends there, and one listed later may start at the same place and reach new text.
            start = match.start()
            for stop in self.stops:
                if start + len(stop) > new_from and text.startswith(stop, start):
                    return start, stop
            pos = start + 1
        return None

    def partial_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

        E.g. ``StopStrings(["upon a"]).partial_length("Once up") == 2``. Cost: at most ``longest - 1``
        slices and hash look-ups.
        """
        for length in range(min(self.longest - 1, len(text)), 0, -1):
            suffix = text[-length:]
            if hash(suffix) in self._prefix_hashes and any(
                    len(stop) > length and stop.startswith(suffix) for stop in self.stops):
                return length
        return 0


def standalone_token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """The text of one token out of context, for logprob alternatives (vLLM shows decoded tokens).

    ``convert_tokens_to_string`` of the token alone, except that a SentencePiece token keeps the spaces
    its leading "▁" marks: its decoder strips the space that starts a text, so ``decode([id("▁there")])``
    is "there" although the token adds " there" after a word. Byte-level tokens ("Ġthere") decode to
    " there" unchanged. An id outside the vocabulary gives "".
    """
    token = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(token, str):
        return ""
    text = tokenizer.convert_tokens_to_string([token])
    marked = len(token) - len(token.lstrip(_SPACE_MARKER))
    spaces = len(text) - len(text.lstrip(" "))
    return " " * (marked - spaces) + text if marked > spaces else text
