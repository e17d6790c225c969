"""Speculative-decoding figures of a benchmark run, from the server's Prometheus counters.

`GET <base>/metrics` is scraped just before and just after the timed run; the run's figures are
the counter increases in between. Tandem names the counters `tandem:spec_decode_*` and vLLM
`vllm:spec_decode_*` (vllm/v1/spec_decode/metrics.py); both are read, summed over every label but
`position` (model_name, vLLM's engine). Derived figures follow vLLM's `SpecDecodingLogging`:
- acceptance rate = accepted tokens / draft tokens;
- mean acceptance length = 1 + accepted tokens / drafts (the bonus token counts, so plain
  decoding would be 1.0);
- acceptance rate at position i = tokens accepted at draft position i (0-based) / drafts.
A server without /metrics, without these counters, or with an unparseable page gives None: the
run itself never fails for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("tandem:", "vllm:")
DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SCRAPE_TIMEOUT_S = 10.0


@dataclass
class SpecCounters:
    """Cumulative counter values at one scrape (counts; per_pos maps a 0-based draft position to
    the tokens accepted there)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)


def _base_name(sample_name: str) -> str | None:
    """`tandem:spec_decode_num_drafts_total` -> `spec_decode_num_drafts`; None for other series
    (including the `_created` timestamps prometheus_client adds)."""
    for prefix in PREFIXES:
        if sample_name.startswith(prefix):
            return sample_name[len(prefix):].removesuffix("_total")
    return None


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters of a Prometheus text page, or None when the three scalar
    counters are not all there (a server without speculative-decoding metrics).

    Raises ValueError when the page is not Prometheus text (prometheus_client's parser).
    """
    counters = SpecCounters()
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _base_name(sample.name)
            if name == ACCEPTED_PER_POS:
                pos = int(sample.labels["position"])
                counters.per_pos[pos] = counters.per_pos.get(pos, 0.0) + sample.value
            elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                attr = "num_" + name.removeprefix("spec_decode_num_")
                setattr(counters, attr, getattr(counters, attr) + sample.value)
            else:
                continue
            seen.add(name)
    return counters if {DRAFTS, DRAFT_TOKENS, ACCEPTED} <= seen else None


async def scrape_spec_counters(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str]
) -> SpecCounters | None:
    """GET `<base_url>/metrics` (a trailing /v1 is dropped) and parse it; None on any HTTP or
    transport error, a non-Prometheus page, or no spec-decode counters. Never raises for those."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        response = await client.get(url, headers=headers, timeout=SCRAPE_TIMEOUT_S)
        response.raise_for_status()
        return parse_spec_counters(response.text)
    except (httpx.HTTPError, ValueError, KeyError, UnicodeDecodeError):
        # NOTE: KeyError is a per-position sample without a `position` label.
        return None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def spec_decode_delta(before: SpecCounters | None, after: SpecCounters | None) -> dict[str, Any] | None:
    """The run's figures (the `spec_decode` entry of a saved result), or None when either scrape
    failed or a counter went down (the server restarted in between).

    Keys: num_drafts, num_draft_tokens, num_accepted_tokens, accepted_tokens_per_position (list,
    position 0 first), acceptance_rate, mean_acceptance_length, acceptance_rate_per_position;
    the rates are None (lists empty) when the run made no draft.
    """
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    num_pos = max([*after.per_pos, *before.per_pos], default=-1) + 1
    per_pos = [after.per_pos.get(i, 0.0) - before.per_pos.get(i, 0.0) for i in range(num_pos)]
    if min([drafts, draft_tokens, accepted, *per_pos]) < 0:
        return None
    if drafts == 0:
        per_pos = []  # NOTE: positions seen in earlier runs say nothing about this one
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "accepted_tokens_per_position": [int(n) for n in per_pos],
        "acceptance_rate": _ratio(accepted, draft_tokens),
        "mean_acceptance_length": None if drafts == 0 else 1.0 + accepted / drafts,
        "acceptance_rate_per_position": [n / drafts for n in per_pos] if drafts else [],
    }
