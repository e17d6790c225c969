"""Structured output with llguidance: grammars compiled off the engine loop, applied as token masks.

The grammar text of a request comes from ``structured_outputs.grammar_text`` (checked at the edge).
``GrammarCompiler`` builds the per-request matchers in a thread pool, cached by grammar text;
``Grammar`` is one request's matcher: the sampler asks it for a token bitmask, the runner feeds it
the accepted tokens. Algorithm and API: llguidance (https://github.com/guidance-ai/llguidance), an
Earley parser over a lexer of the tokenizer's trie; a mask costs tens of microseconds.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import torch

from tandem.sampling_params import StructuredOutputsParams
from tandem.structured_outputs import grammar_text

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled matchers kept per compiler (LRU), keyed by grammar text


def make_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast HF tokenizer: ``vocab_size`` = the model's logits width (ids past
    the tokenizer's own are never allowed), the model's EOS ids allowed wherever the grammar is complete.

    Raises:
        ValueError: a slow (non-``tokenizers``) tokenizer.
    """
    eos = sorted(eos_token_ids) or None
    import llguidance.hf  # imports transformers; only needed once a grammar is compiled

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


class Grammar:
    """One request's matcher (llguidance ``LLMatcher``): which tokens may come next, and the tokens so far.

    ``accept`` advances it over sampled tokens. ``error``: why the matcher failed (None while it
    works): it failed to build, hit one of llguidance's limits (``a{500000}`` exceeds its lexer's:
    "lexer error: too many expressions constructed") or was fed a token it forbids. A failed matcher
    allows only EOS, so the text would end unconstrained; the runner ends such a request with an
    error instead (``ModelRunnerOutput.failed``). ``is_stopped``: only EOS may follow (the text is
    complete and cannot grow).
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None
        self.check_error()

    def check_error(self) -> str | None:
        """Records the matcher's error, if it has one (the first line of llguidance's message)."""
        if self.error is None and self.matcher.is_error():
            self.error = self.matcher.get_error().splitlines()[0] or "the grammar matcher failed"
        return self.error

    def accept(self, token_ids: list[int]) -> None:
        """Consumes ``token_ids``; changes the matcher's state, and ``error`` when one fails. Tokens after
        the grammar stopped (the EOS that ends the request) are not fed to it."""
        for token in token_ids:
            if self.error is not None or self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                self.check_error()
                return

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar allows from here. Changes nothing."""
        return self.matcher.validate_tokens(token_ids) if token_ids else 0

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()


def fill_bitmask(grammars: list[Grammar], bitmask: torch.Tensor, drafts: list[list[int]] | None = None) -> None:
    """Writes each grammar's allowed-token bitmask into ``bitmask [rows, ceil(V / 32)]`` int32.

    Without ``drafts`` grammar i fills row i. With ``drafts`` grammar i fills ``1 + len(drafts[i])``
    consecutive rows: the mask now, then after each draft token while the drafts stay valid (the
    matcher is advanced over them, then rolled back); rows after an invalid draft keep their content
    (that draft is masked out, so verification rejects it and never reads them).
    Changes: ``bitmask``, and the ``error`` of a grammar whose matcher failed meanwhile (a limit);
    the other matchers end where they started.
    """
    row = 0
    for i, grammar in enumerate(grammars):
        matcher = grammar.matcher
        row_drafts = drafts[i] if drafts is not None else []
        _fill_row(matcher, bitmask, row)
        consumed = 0
        for token in row_drafts:
            if matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
                break
            consumed += 1
            _fill_row(matcher, bitmask, row + consumed)
        if consumed:
            matcher.rollback(consumed)
        grammar.check_error()
        row += 1 + len(row_drafts)


def _fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write ``matcher``'s next-token mask into ``bitmask[row]`` (contiguous int32 words).

    What ``llguidance.torch.fill_next_token_bitmask`` does, without importing that module: it
    decorates a function with ``torch.compile`` at import, which loads torch._dynamo (about 4 s of
    every server start-up).
    Raises: ValueError when ``bitmask`` is not int32 or its row is not contiguous.
    """
    words = bitmask[row]
    if bitmask.dtype != torch.int32 or not words.is_contiguous():
        raise ValueError(f"bitmask must be a contiguous int32 [rows, words] tensor, got {bitmask.dtype}")
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(vocab_size / 32)]`` int32, all bits set (every token allowed)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarCompiler:
    """Compiles request grammars in a background thread, keeping the last ``MAX_CACHED_GRAMMARS``.

    Args:
        load_tokenizer: returns the model's HF tokenizer (called once, in the compile thread).
        vocab_size: the model's logits width.
        num_threads: compile threads (llguidance drops the GIL while it builds a lexer).

    ``submit`` returns at once; the future's ``done()`` is the request's readiness check, so the
    scheduler admits the request only once its grammar is built and never waits for it.
    """

    def __init__(self, load_tokenizer: Any, vocab_size: int, num_threads: int = 1) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tandem-grammar")
        self._tokenizers: dict[frozenset[int], llguidance.LLTokenizer] = {}
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def submit(self, params: StructuredOutputsParams, eos_token_ids: frozenset[int]) -> Future[Grammar]:
        """Starts building a fresh ``Grammar`` for ``params``. Changes: the cache (in the thread)."""
        return self._pool.submit(self._build, params, eos_token_ids)

    def _build(self, params: StructuredOutputsParams, eos_token_ids: frozenset[int]) -> Grammar:
        text = grammar_text(params)
        key = f"{sorted(eos_token_ids)}:{text}"
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return Grammar(template.deep_copy())
        matcher = llguidance.LLMatcher(self._tokenizer(eos_token_ids), text, log_level=0)
        # NOTE: the first mask builds the lexer's states over the vocabulary (0.5 s for a{500000} with a
        # 512-token vocabulary, 0.08 s after); built here, not in the engine's first step with it.
        _fill_row(matcher, allocate_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            # NOTE: the edge checked this grammar; the runner ends the request with this error.
            logger.error("grammar failed to build: %s", matcher.get_error().splitlines()[0])
            return Grammar(matcher)
        with self._lock:
            self._cache[key] = matcher.deep_copy()
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return Grammar(matcher)

    def _tokenizer(self, eos_token_ids: frozenset[int]) -> llguidance.LLTokenizer:
        tokenizer = self._tokenizers.get(eos_token_ids)
        if tokenizer is None:
            tokenizer = make_tokenizer(self._load_tokenizer(), self.vocab_size, eos_token_ids)
            self._tokenizers[eos_token_ids] = tokenizer
        return tokenizer

    def shutdown(self) -> None:
        """Stops the compile threads (pending builds are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
