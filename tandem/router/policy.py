"""Routing policies: which backend (engine core or HTTP server) gets the next request. No model, no I/O.

The interface, shared by the standalone ``tandem router`` and ``tandem serve -dp N``:

- ``BackendState``: one backend as the router sees it: ``name``, ``outstanding_requests``,
  ``outstanding_tokens`` (prompt + requested output tokens of its dispatched, unfinished requests),
  ``healthy`` (set by the health checker), ``max_outstanding`` (router-side cap on requests, None =
  none), ``probation`` (half-open after an ejection: one request at a time) and ``index`` (a
  ``kv_index.BlockIndex``: ``EventBlockIndex`` when the backend publishes KV events, else
  ``ApproxBlockIndex``).
- ``make_policy(name, beta=..., min_match=...)`` -> ``RoundRobinPolicy`` | ``LeastLoadPolicy`` |
  ``KVAwarePolicy``.
- ``policy.choose(prompt_block_hashes, backends, exclude=(), retry=False) -> BackendState``: picks
  among the *eligible* backends (healthy, not full, not excluded: ``eligible``). No state changes
  except the round-robin cursor (not moved by a ``retry``). Raises ``NoHealthyBackendError`` when none is healthy and
  ``AllBackendsFullError`` when every healthy one is full or excluded (the router answers 503 /
  429 with ``Retry-After``).
- ``ticket = policy.on_dispatch(backend, prompt_block_hashes, num_tokens)`` when the request is sent,
  ``policy.on_complete(ticket)`` exactly once when it ends (finished, failed, or cancelled). They
  keep the load counters and the backend's index's pending entries.

Policies:

- ``round-robin``: the next eligible backend in a fixed cycle.
- ``least-load``: fewest ``outstanding_tokens`` (ties: fewest requests, then list order).
- ``kv-aware`` (default): ``score = cached - beta * load / max_load``, where ``cached`` is
  ``matched / len(prompt_block_hashes)`` (``matched`` = ``index.match(prompt_block_hashes)``, the
  leading blocks cached there), counted as 0 when it is below ``min_match``, and ``load / max_load``
  is the backend's outstanding tokens relative to the busiest eligible backend (0 when all are
  idle). Highest score wins; ties go to the least loaded. With ``beta < 1`` a full prefix hit
  outweighs any load difference, so requests sharing a prefix stay together while prompts without
  a hit spread by load. ``min_match`` (default 0.3) keeps a small match (a chat template's first
  block, a few blocks left after evictions) from pulling a prompt to the busier backend: such a
  prompt is routed by load alone, as ``least-load`` would. After SGLang's cache-aware router (its
  ``cache_threshold``, also 0.3 there) and the KV-event router of NVIDIA Dynamo / vLLM's
  production stack (which score overlap minus load the same way).

Not thread-safe: one asyncio loop calls everything.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tandem.router.kv_index import ApproxBlockIndex, BlockIndex

POLICIES = ("round-robin", "least-load", "kv-aware")
DEFAULT_POLICY = "kv-aware"
DEFAULT_BETA = 0.5
DEFAULT_MIN_MATCH = 0.3


class NoBackendError(Exception):
    """No backend can take the request now (the router turns it into an HTTP error with Retry-After)."""

    status_code = 503


class NoHealthyBackendError(NoBackendError):
    """Every backend is ejected (unhealthy): 503."""

    status_code = 503


class AllBackendsFullError(NoBackendError):
    """Every healthy backend is at its outstanding-request cap: 429."""

    status_code = 429


@dataclass(eq=False)
class BackendState:
    """One backend's routing state (mutable; the router owns it).

    Attributes:
        name: a unique label (the URL of an HTTP backend, the rank of an engine core).
        outstanding_requests / outstanding_tokens: dispatched, not yet completed (tokens = prompt +
            requested output tokens).
        healthy: False while ejected (the health checker sets it).
        max_outstanding: the router-side cap on outstanding requests (None: no cap).
        probation: half-open after an ejection (``health.py``): at most one outstanding request.
        index: which blocks it holds (see ``kv_index``).
    """

    name: str
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    healthy: bool = True
    max_outstanding: int | None = None
    probation: bool = False
    index: BlockIndex = field(default_factory=ApproxBlockIndex)

    @property
    def full(self) -> bool:
        """At its cap: ``max_outstanding`` requests, or one while on probation."""
        cap = 1 if self.probation else self.max_outstanding
        return cap is not None and self.outstanding_requests >= cap


@dataclass(eq=False)
class Ticket:
    """One dispatched request, handed back to ``on_complete``.

    Attributes:
        matched_blocks: leading prompt blocks the index believed cached at dispatch (the routed hit).
    """

    backend: BackendState
    block_hashes: Sequence[int]
    num_tokens: int
    matched_blocks: int
    done: bool = False


def eligible(backends: Sequence[BackendState], exclude: Collection[BackendState] = ()) -> list[BackendState]:
    """The healthy backends below their cap and not in ``exclude``.

    ``exclude``: backends this request may not use now (already tried, busy after answering 429);
    a healthy one among them counts as full.

    Raises:
        NoHealthyBackendError: none is healthy (or ``backends`` is empty).
        AllBackendsFullError: every healthy one is full or excluded.
    """
    healthy = [b for b in backends if b.healthy]
    if not healthy:
        raise NoHealthyBackendError("no healthy backend")
    free = [b for b in healthy if not b.full and b not in exclude]
    if not free:
        raise AllBackendsFullError("every backend is at its outstanding-request limit")
    return free


def _load_key(b: BackendState) -> tuple[int, int]:
    return (b.outstanding_tokens, b.outstanding_requests)


class Policy:
    """Base: the dispatch / completion bookkeeping every policy shares; subclasses implement ``_pick``."""

    name = ""

    def choose(self, prompt_block_hashes: Sequence[int], backends: Sequence[BackendState],
               exclude: Collection[BackendState] = (), retry: bool = False) -> BackendState:
        """The backend for a prompt with these chained block hashes (may be empty), not one of ``exclude``.
        ``retry``: another choice for a request that already went to a backend (round-robin's cursor
        stays where its first choice put it).

        Raises:
            NoHealthyBackendError, AllBackendsFullError: see ``eligible``.
        """
        return self._pick(prompt_block_hashes, eligible(backends, exclude), backends, retry)

    def _pick(self, hashes: Sequence[int], candidates: list[BackendState],
              backends: Sequence[BackendState], retry: bool) -> BackendState:
        raise NotImplementedError

    def on_dispatch(self, backend: BackendState, prompt_block_hashes: Sequence[int], num_tokens: int) -> Ticket:
        """Counts a request sent to ``backend`` (``num_tokens`` = prompt + requested output tokens).

        Changes: the backend's outstanding counters and its index's pending entries.
        """
        matched = backend.index.match(prompt_block_hashes)
        backend.outstanding_requests += 1
        backend.outstanding_tokens += num_tokens
        backend.index.on_dispatch(prompt_block_hashes)
        return Ticket(backend, prompt_block_hashes, num_tokens, matched)

    def on_complete(self, ticket: Ticket) -> None:
        """Ends a dispatched request's accounting; a second call for one ticket does nothing.

        Changes: the backend's outstanding counters and its index's pending entries; ``ticket.done``.
        """
        if ticket.done:
            return
        ticket.done = True
        b = ticket.backend
        b.outstanding_requests -= 1
        b.outstanding_tokens -= ticket.num_tokens
        b.index.on_complete(ticket.block_hashes)


class RoundRobinPolicy(Policy):
    """The next eligible backend after the last one chosen, in the order of the backends list. A retry
    does not move the cursor: otherwise, with a backend that fails every request, the retry's choice
    would put that backend first in line for every next request."""

    name = "round-robin"

    def __init__(self) -> None:
        self._cursor = -1  # index in the backends list of the last first choice

    def _pick(self, hashes, candidates, backends, retry):
        n = len(backends)
        for step in range(1, n + 1):
            i = (self._cursor + step) % n
            if backends[i] in candidates:
                if not retry:
                    self._cursor = i
                return backends[i]
        raise AssertionError("eligible() returned a backend that is not in the list")


class LeastLoadPolicy(Policy):
    """Fewest outstanding tokens, then fewest outstanding requests, then list order."""

    name = "least-load"

    def _pick(self, hashes, candidates, backends, retry):
        return min(candidates, key=_load_key)


class KVAwarePolicy(Policy):
    """Cached fraction of the prompt minus ``beta`` times relative load (see the module docstring).

    Args:
        beta: weight of the relative load (>= 0).
        min_match: a cached fraction below this counts as 0 (in [0, 1]; 0 counts every match).

    Raises:
        ValueError: ``beta < 0`` or ``min_match`` outside [0, 1].
    """

    name = "kv-aware"

    def __init__(self, beta: float = DEFAULT_BETA, min_match: float = DEFAULT_MIN_MATCH) -> None:
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if not 0 <= min_match <= 1:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        self.beta = beta
        self.min_match = min_match

    def scores(self, prompt_block_hashes: Sequence[int], candidates: Sequence[BackendState]) -> list[float]:
        """Each candidate's score, in order. No state changes."""
        max_load = max(b.outstanding_tokens for b in candidates)
        n = len(prompt_block_hashes)
        out = []
        for b in candidates:
            cached = b.index.match(prompt_block_hashes) / n if n else 0.0
            if cached < self.min_match:
                cached = 0.0
            load = b.outstanding_tokens / max_load if max_load > 0 else 0.0
            out.append(cached - self.beta * load)
        return out

    def _pick(self, hashes, candidates, backends, retry):
        scores = self.scores(hashes, candidates)
        best = max(range(len(candidates)), key=lambda i: (scores[i], [-x for x in _load_key(candidates[i])]))
        return candidates[best]


def make_policy(name: str = DEFAULT_POLICY, beta: float = DEFAULT_BETA,
                min_match: float = DEFAULT_MIN_MATCH) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``); ``beta`` and ``min_match``: see ``KVAwarePolicy``.

    Raises:
        ValueError: an unknown name, a negative ``beta`` or ``min_match`` outside [0, 1].
    """
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-load":
        return LeastLoadPolicy()
    if name == "kv-aware":
        return KVAwarePolicy(beta, min_match)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
