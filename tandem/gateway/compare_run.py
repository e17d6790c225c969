"""`tandem compare --a URL --b URL`: the regression set against two servers, with noise.

Each case is sent to A, to A again (the noise baseline), then to B, one request at a time. A vs B
is compared tier by tier (`compare.compare_answers`), A vs A gives the noise, and the differences
left after subtracting A's own (Diffy's rule) are the report's findings. Per-side checks: a
must-fail case answered with its status, a stream whose text equals the whole answer's, no U+FFFD
in a text. Exit code 1 when a difference beyond noise or a failed check remains, else 0.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.gateway.answer import answer_of
from tandem.gateway.capture import Capture
from tandem.gateway.compare import compare_answers, divergence_report, subtract_noise
from tandem.gateway.config import BackendConfig, redact_text
from tandem.gateway.regression import FILLER, Case
from tandem.gateway.upstream import fetch_capture


@dataclass(frozen=True)
class Side:
    """One server under comparison: label (`a` or `b`), root URL, key, the model name it serves."""

    label: str
    url: str
    api_key: str | None
    model: str | None = None

    def backend(self) -> BackendConfig:
        return BackendConfig(self.label, self.url, self.api_key)


async def probe(client: httpx.AsyncClient, side: Side) -> tuple[str, int | None, float | None]:
    """(model, max_model_len, tokens per FILLER) from `/v1/models` and `/tokenize` (None where the
    server does not tell). Raises httpx.HTTPError / ValueError when `/v1/models` fails and no
    model was given."""
    url = side.backend().url
    headers = {"Authorization": f"Bearer {side.api_key}"} if side.api_key else {}
    model, max_len = side.model, None
    try:
        cards = (await client.get(f"{url}/v1/models", headers=headers)).raise_for_status().json()["data"]
        card = next((c for c in cards if c.get("id") == model), cards[0]) if cards else {}
        model = model or card["id"]
        max_len = card.get("max_model_len")
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        if model is None:
            raise
    per_filler = None
    try:
        r = await client.post(f"{url}/tokenize", json={"model": model, "prompt": FILLER * 10}, headers=headers)
        if r.status_code == 200 and isinstance(r.json().get("count"), int):
            per_filler = r.json()["count"] / 10
            max_len = max_len or r.json().get("max_model_len")
    except (httpx.HTTPError, ValueError):
        pass
    return model, max_len, per_filler


def error_of(capture: Capture) -> str | None:
    """Why an answer failed: the transport error, the OpenAI error message, or its HTTP status."""
    if capture.error:
        return capture.error
    if capture.ok:
        return None
    body = capture.body
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {capture.status}: {message or str(body)[:200]}"


def not_run_reason(case: Case, cap_a: Capture, cap_b: Capture) -> str | None:
    """Why a case did not run on either side (both failed and no error status was expected), or None."""
    if case.expect_status is not None or cap_a.ok or cap_b.ok:
        return None
    if case.refusal_ok and all(c.status is not None and 400 <= c.status < 500 for c in (cap_a, cap_b)):
        return None
    return f"A: {error_of(cap_a)}; B: {error_of(cap_b)}"


def summarize_capture(capture: Capture) -> dict[str, Any]:
    """What the report shows of one answer (texts cut to 300 characters)."""
    a = answer_of(capture)
    return {"status": a.status, "error": error_of(capture), "error_type": a.error_type, "error_code": a.error_code,
            "texts": [t[:300] for t in a.texts], "finish_reasons": a.finish, "usage": a.usage,
            "tool_calls": a.tool_calls, "stream": a.stream, "choice_chunks": a.chunks if a.stream else None,
            "done": a.done if a.stream else None, "ttft_s": capture.ttft_s, "latency_s": capture.latency_s}


def _broken_utf8(text: str, finish: str | None) -> bool:
    """True when `text` holds U+FFFD other than at the end of an answer cut by its token budget
    (`finish_reason` "length" may end inside a multi-byte character; HF's decode, vLLM and Tandem
    then end the text with U+FFFD)."""
    return "\ufffd" in (text.rstrip("\ufffd") if finish == "length" else text)


def side_checks(case: Case, capture: Capture, texts_by_case: dict[str, list[str]]) -> list[str]:
    """Failed per-side checks of one answer (empty when all pass)."""
    failed = []
    answer = answer_of(capture)
    if case.expect_status is not None and capture.status != case.expect_status:
        failed.append(f"expected HTTP {case.expect_status}, got {capture.status}")
    if any(_broken_utf8(t, f) for t, f in zip(answer.texts, answer.finish, strict=True)):
        failed.append("text holds U+FFFD (a broken UTF-8 sequence)")
    if case.same_text_as and capture.ok and case.same_text_as in texts_by_case:
        if answer.texts != texts_by_case[case.same_text_as]:
            failed.append(f"streamed text differs from the whole answer of {case.same_text_as}")
    if capture.stream and capture.ok and not capture.done:
        failed.append("stream ended without [DONE]")
    return failed


async def _send(client: httpx.AsyncClient, side: Side, case: Case, timeout_s: float) -> Capture:
    body = case.raw_body if case.raw_body is not None else json.dumps(case.request(side.model)).encode()
    headers = {"content-type": "application/json"}
    backend = side.backend()
    if backend.api_key:
        headers["authorization"] = f"Bearer {backend.api_key}"
    return await fetch_capture(client, backend, f"v1/{case.endpoint}", headers, body, timeout_s)


async def run_cases(a: Side, b: Side, cases: list[Case], timeout_s: float) -> dict[str, Any]:
    """Runs every case (A, A again, B) and returns the report document."""
    rows, signals, noises = [], [], []
    texts: dict[str, dict[str, list[str]]] = {"a": {}, "b": {}}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for case in cases:
            cap_a = await _send(client, a, case, timeout_s)
            cap_a2 = await _send(client, a, case, timeout_s)
            cap_b = await _send(client, b, case, timeout_s)
            request = case.request(a.model) if case.raw_body is None else {}
            signal, noise = compare_answers(request, cap_a, cap_b), compare_answers(request, cap_a, cap_a2)
            signals.append(signal)
            noises.append(noise)
            checks = {"a": side_checks(case, cap_a, texts["a"]), "b": side_checks(case, cap_b, texts["b"])}
            texts["a"][case.name], texts["b"][case.name] = answer_of(cap_a).texts, answer_of(cap_b).texts
            rows.append({
                "name": case.name, "endpoint": case.endpoint, "notes": case.notes,
                "request": request if len(json.dumps(request)) < 2000 else {"omitted": "long prompt"},
                "expect_status": case.expect_status, "a": summarize_capture(cap_a), "b": summarize_capture(cap_b),
                "diffs": [vars(d) for d in signal.diffs], "noise_diffs": [vars(d) for d in noise.diffs],
                "diffs_beyond_noise": [vars(d) for d in subtract_noise(signal, noise).diffs], "failed_checks": checks,
                "not_run": not_run_reason(case, cap_a, cap_b),
            })
    summary = divergence_report(signals, noises)
    summary["failed_checks"] = sum(len(r["failed_checks"]["a"]) + len(r["failed_checks"]["b"]) for r in rows)
    summary["cases_with_differences_beyond_noise"] = sum(bool(r["diffs_beyond_noise"]) for r in rows)
    summary["cases_not_run"] = sum(r["not_run"] is not None for r in rows)
    # NOTE: the sides' API keys and URL userinfo are never written into a report
    sides = {s.label: {"url": redact_text(s.url), "model": s.model} for s in (a, b)}
    return {**sides, "summary": summary, "cases": rows}


def run_compare(a: Side, b: Side, cases_fn, timeout_s: float = 120.0) -> dict[str, Any]:
    """Probes both sides (model names, context limits), builds the cases with `cases_fn(smallest
    max_model_len, tokens_per_filler, largest max_model_len)` and runs them. Raises httpx.HTTPError
    when a side is unreachable."""

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as client:
            model_a, len_a, per_a = await probe(client, a)
            model_b, len_b, _ = await probe(client, b)
        sides = (Side(a.label, a.url, a.api_key, model_a), Side(b.label, b.url, b.api_key, model_b))
        limits = [n for n in (len_a, len_b) if n]
        smallest, largest = (min(limits), max(limits)) if limits else (None, None)
        report = await run_cases(*sides, cases_fn(smallest, per_a, largest), timeout_s)
        report["max_model_len"] = {"a": len_a, "b": len_b}
        return report

    return asyncio.run(main())
