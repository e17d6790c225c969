"""The gateway's request rewrite and its undoing in answers (model-name mapping back, stream usage
asked for and stripped), URL redaction and the drill's verdict, without a network."""

from __future__ import annotations

import json

import pytest

from tandem.gateway.config import BackendConfig, redact_text
from tandem.gateway.rewrite import AnswerFilter, Rewrite, listing_rewrite, rewrite_request

BACKEND = BackendConfig("candidate", "http://b:1", None, {"stories": "stories-next"})


def _stream(model: str, include_usage: bool) -> bytes:
    """A chat stream as Tandem and OpenAI write it: with include_usage every chunk has
    `"usage": null` and a usage chunk (`choices: []`) comes before [DONE]."""
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": model, "system_fingerprint": None}
    deltas = [{"role": "assistant", "content": ""}, {"content": 'say "model": "stories-next"'}, {"content": "!"}]
    events = []
    for i, delta in enumerate(deltas):
        event = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if i == 2 else None}]}
        events.append({**event, "usage": None} if include_usage else event)
    if include_usage:
        events.append({**head, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                         "total_tokens": 6}})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _filtered(rewrite: Rewrite, raw: bytes, piece: int) -> bytes:
    f = AnswerFilter(rewrite)
    out = b"".join(f.feed(raw[i:i + piece]) for i in range(0, len(raw), piece))
    return out + f.finish()


def test_request_unchanged_unless_mapped_or_streamed_without_usage():
    raw = b'{"model":"other","prompt":"x","zz_unknown":[1]}'
    assert rewrite_request(BACKEND, raw, json.loads(raw), True) == Rewrite(raw)
    raw = b'{"model":"other","stream":true,"stream_options":{"include_usage":true}}'
    assert rewrite_request(BACKEND, raw, json.loads(raw), True).body == raw
    body = {"model": "stories", "stream": True, "stream_options": {"continuous_usage_stats": True}, "zz": 1}
    r = rewrite_request(BACKEND, json.dumps(body).encode(), body, True)
    assert json.loads(r.body) == {"model": "stories-next", "stream": True, "zz": 1,
                                  "stream_options": {"continuous_usage_stats": False, "include_usage": True}}
    assert (r.renames, r.usage_added) == ((("model", "stories-next", "stories"),), True)
    # a non-generation path (e.g. /v1/embeddings) is never asked for stream usage
    assert not rewrite_request(BACKEND, b'{"stream":true}', {"stream": True}, False).usage_added


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_stream_gets_client_model_back_and_loses_the_usage_it_did_not_ask_for(piece):
    body = {"model": "stories", "stream": True}
    rewrite = rewrite_request(BACKEND, json.dumps(body).encode(), body, True)
    backend_said = _stream("stories-next", include_usage=True)
    # exactly the bytes the backend sends a client that asked for `stories` without usage
    assert _filtered(rewrite, backend_said, piece) == _stream("stories", include_usage=False)
    # a client that asked for usage keeps it (only the name changes)
    body["stream_options"] = {"include_usage": True}
    rewrite = rewrite_request(BACKEND, json.dumps(body).encode(), body, True)
    assert _filtered(rewrite, backend_said, piece) == _stream("stories", include_usage=True)


def test_json_answer_model_mapped_back_text_untouched():
    rewrite = Rewrite(b"", (("model", "stories-next", "stories"),))
    raw = b'{"id":"x","model": "stories-next","choices":[{"text":"{\\"model\\": \\"stories-next\\"}"}]}'
    assert AnswerFilter(rewrite).json_body(raw) == raw.replace(b'"model": "stories-next"', b'"model": "stories"', 1)
    assert AnswerFilter(Rewrite(b"")).json_body(raw) == raw
    # a model list names the client's models; an unmapped one and other keys stay
    backend = BackendConfig("c", "http://b:1", None, {"stories": "s-next", "alias": "s-next", "caf\u00e9": "b\u00e9"})
    listing = '{"data":[{"id":"s-next","root":"s-next"},{"id":"b\u00e9"},{"id":"other"}]}'.encode()
    assert listing_rewrite(backend, b"", "models/stories") == ("models/s-next", Rewrite(b"", (("id", "s-next",
                                                                                                "stories"),)))
    assert listing_rewrite(backend, b"", "models/other")[0] == "models/other"
    assert AnswerFilter(listing_rewrite(backend, b"")[1]).json_body(listing) == \
        '{"data":[{"id":"stories","root":"s-next"},{"id":"caf\u00e9"},{"id":"other"}]}'.encode()


def test_usage_null_as_first_key_and_crlf_lines():
    rewrite = Rewrite(b"", usage_added=True)
    raw = (b'data: {"usage": null, "choices": [{"text": "a"}]}\r\n\r\n'
           b'data: {"choices": [], "usage": {"completion_tokens": 1}}\r\n\r\ndata: [DONE]\r\n\r\n')
    assert _filtered(rewrite, raw, 3) == b'data: {"choices": [{"text": "a"}]}\r\n\r\ndata: [DONE]\r\n\r\n'


def test_url_userinfo_is_redacted():
    assert redact_text("http://alice:s3cret@h:8000") == "http://***@h:8000"
    assert redact_text("candidate: ConnectError at https://k@h/v1 and http://h/a@b") == \
        "candidate: ConnectError at https://***@h/v1 and http://h/a@b"


def _report(lost_in_flight: int, lost_after: int, fallback: float | None = 0.4) -> dict:
    return {"fallback_time_s": fallback, "recovered": fallback is not None, "requests_total": 30,
            "requests_lost": lost_in_flight + lost_after, "after_stop": {"lost": lost_after},
            "in_flight_at_stop": {"count": 3, "completed": 3 - lost_in_flight,
                                  "ended_with_error_event": lost_in_flight, "failed_otherwise": 0}}


def test_drill_fails_on_any_lost_request_in_flight_included(monkeypatch, tmp_path, capsys):
    from tandem.cli import main
    from tandem.gateway import drill

    assert drill.verdict(_report(0, 0)) == (True, "PASSED: fell back in 0.400 s, no client request lost.")
    assert drill.verdict(_report(2, 0)) == (False, "FAILED: 2 client request(s) lost of 30: 2 in flight at the "
                                                   "stop, 0 started after it, 0 ended before it.")
    assert not drill.verdict(_report(0, 0, fallback=None))[0]
    base = {"gateway": "http://gw", "stop_command": "kill 1", "stop_exit_code": 0, "stop_command_took_s": 0.01,
            "candidate_down_after_s": 0.1, "before_stop": {}, "gateway_before": {}, "gateway_after": {},
            "continuity": {"scrapes_ok": 9, "scrape_failures": 0, "max_gap_between_scrapes_s": 0.3,
                           "requests_counter_monotonic": True, "event_log_gaps": [], "events": []}}
    phase = {"requests": 15, "lost": 0, "served_by": {"primary": 15}, "median_ttft_ms": 5.0, "p99_e2el_ms": 9.0}

    def fake_run(lost_in_flight):
        report = {**base, **_report(lost_in_flight, 0)}
        report["before_stop"] = {**phase, "lost": lost_in_flight}
        report["after_stop"] = phase
        report["passed"], report["verdict"] = drill.verdict(report)
        return lambda config: report

    args = ["drill", "--gateway", "http://gw", "--candidate-stop", "kill 1", "--output-dir", str(tmp_path)]
    monkeypatch.setattr(drill, "run_drill", fake_run(2))
    assert main(args) == 1  # the streams in flight at the kill were lost: the drill fails
    assert "**FAILED: 2 client request(s) lost of 30: 2 in flight at the stop" in capsys.readouterr().out
    monkeypatch.setattr(drill, "run_drill", fake_run(0))
    assert main(args) == 0 and "**PASSED: fell back in 0.400 s" in capsys.readouterr().out


def test_backend_credentials_either_as_key_or_as_userinfo():
    with pytest.raises(ValueError, match="give its credentials as api_key or as URL userinfo, not both"):
        BackendConfig("candidate", "http://ops:pw@h:1", "key")
