"""Which ready waiting requests the scheduler holds back this step so that others go first.

Two rules, both skips (the request keeps its place in the waiting queue and blocks nobody behind it):

- **In-flight prefix** (on with prefix caching; SGLang's "in-batch prefix caching" check in its
  scheduler policy): a request whose first uncached block is being computed by a running request
  (a block that request will write, not yet in the cache) waits. Once that request's step wrote the
  blocks, this one is admitted with them as a prefix hit, instead of computing the same prefix a
  second time alongside. Chained block hashes (``kv_cache/hashing.py``) name whole prefixes, so one
  hash equal means every block before it is equal too.
- **Long prefills one at a time** (``SchedulerConfig.max_long_partial_prefills`` with
  ``long_prefill_token_threshold``; vLLM's option of that name): a request with more than the
  threshold of tokens left to compute is *long*; while ``max_long_partial_prefills`` running requests
  are long, another long one waits, so requests with a short rest (a prefix hit plus a question, a
  short prompt) are admitted and sample in the next step instead of queueing behind every long
  prompt's chunks. On a CPU, where a 1,000-token chunk takes seconds, this is what turns a prefix hit
  into a short time to first token.

The gate is built once per ``schedule()`` from the running requests (after they were scheduled) and
told of each admission. It changes no request.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.request import Request


def _rest(request: Request, start: int) -> int:
    return request.num_tokens - start


class AdmissionGate:
    """One step's admission skips (see the module docstring).

    Args:
        running: the running requests, before this step's results (``num_computed_tokens`` not yet
            advanced over this step's chunks).
        block_size: tokens per KV block.
        prefix_caching: whether the in-flight prefix rule applies (no cache: no hit to wait for).
        long_threshold: tokens left above which a request is long (0: no request is long).
        max_long: how many long requests may run at once (0: no limit).
    """

    def __init__(self, running: Iterable[Request], block_size: int, prefix_caching: bool,
                 long_threshold: int, max_long: int) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.long_threshold = long_threshold if max_long > 0 else 0
        self.max_long = max_long
        self.in_flight: set[int] = set()  # hashes of blocks running requests will write
        self.num_long = 0
        for request in running:
            self.admitted(request, request.num_computed_tokens)

    def _is_long(self, request: Request, start: int) -> bool:
        return self.long_threshold > 0 and _rest(request, start) > self.long_threshold

    def holds_back(self, request: Request, start: int, hit_possible: bool) -> bool:
        """Whether ``request``, about to compute from token ``start`` (after its prefix hit), waits.

        ``hit_possible``: False where the request may not take prefix hits (prompt logprobs, KV from
        elsewhere), so waiting for one would gain nothing. Changes nothing.
        """
        if self._is_long(request, start) and self.num_long >= self.max_long:
            return True
        if not (hit_possible and self.prefix_caching and self.in_flight):
            return False
        i = start // self.block_size  # the first block not in the cache
        return i < len(request.block_hashes) and request.block_hashes[i] in self.in_flight

    def admitted(self, request: Request, start: int) -> None:
        """Counts a request that runs from token ``start``: its blocks from there on are in flight.

        Changes: the in-flight hashes and the long count.
        """
        if self.prefix_caching:
            self.in_flight.update(request.block_hashes[start // self.block_size:])
        if self._is_long(request, start):
            self.num_long += 1
