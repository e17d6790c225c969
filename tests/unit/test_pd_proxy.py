"""The P/D proxy (``router/pd.py``) against fake prefill and decode servers (httpx MockTransport, no model):
vLLM's two legs, short prompts (``--disagg-min-prompt-tokens``) straight to decode, an unreachable
prefill server, a prefill refusal passed through."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tandem.router.health import HealthState
from tandem.router.pd import PDConfig, PDProxy, build_pd_app

PREFILL, DECODE = "http://prefill:8100", "http://decode:8200"
KV = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 14579, "remote_block_ids": [0, 1]}


def serve(body: dict, *, prefill_status: int = 200, prefill_down: bool = False,
          connect_timeouts: int = 0) -> tuple[httpx.Response, list]:
    """Sends ``body`` through a PDProxy (threshold 16 tokens) whose servers are fakes; returns the client's
    answer and the (url, body) of every upstream request. ``connect_timeouts``: each leg's first attempts
    that time out connecting."""
    seen: list[tuple[str, dict]] = []
    timeouts = {PREFILL: connect_timeouts, DECODE: connect_timeouts}

    def upstream(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        server = PREFILL if str(request.url).startswith(PREFILL) else DECODE
        if request.url.path != "/tokenize" and timeouts[server] > 0:
            timeouts[server] -= 1
            raise httpx.ConnectTimeout("")
        seen.append((str(request.url), sent))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": len(sent["prompt"].split())})
        if str(request.url).startswith(PREFILL):
            if prefill_down:
                raise httpx.ConnectError("connection refused")
            if prefill_status != 200:
                return httpx.Response(prefill_status, json={"error": {"message": "too long"}})
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}], "kv_transfer_params": None})

    async def main() -> httpx.Response:
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        proxy = PDProxy(PDConfig(prefill=(PREFILL,), decode=(DECODE,), min_prompt_tokens=16), client)
        app = httpx.ASGITransport(app=build_pd_app(proxy))
        async with httpx.AsyncClient(transport=app, base_url="http://router") as router:
            return await router.post("/v1/completions", json=body)

    return asyncio.run(main()), seen


def test_long_prompt_takes_both_legs_as_vllm_sends_them():
    body = {"prompt": " ".join(["word"] * 40), "max_tokens": 12, "stream": False, "temperature": 0.0}
    answer, seen = serve(body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decoded"
    assert [url for url, _ in seen] == [f"{DECODE}/tokenize", f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions"]
    prefill_leg, decode_leg = seen[1][1], seen[2][1]
    assert prefill_leg == {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}}
    assert decode_leg == {**body, "kv_transfer_params": KV}


def test_short_prompt_goes_straight_to_decode():
    body = {"prompt": "a short one", "max_tokens": 12}
    answer, seen = serve(body)
    assert answer.status_code == 200
    assert seen == [(f"{DECODE}/tokenize", {"model": None, "prompt": "a short one"}),
                    (f"{DECODE}/v1/completions", body)]


def test_unreachable_prefill_lets_decode_prefill_and_a_refusal_is_passed_through():
    body = {"prompt": " ".join(["word"] * 40), "max_tokens": 12}
    answer, seen = serve(body, prefill_down=True)
    assert answer.status_code == 200 and seen[-1] == (f"{DECODE}/v1/completions", body)
    answer, seen = serve(body, prefill_status=400)
    assert answer.status_code == 400 and answer.json() == {"error": {"message": "too long"}}
    assert [url for url, _ in seen][-1] == f"{PREFILL}/v1/completions"


def test_the_prefill_leg_is_one_completion_of_one_token():
    """n, best_of and min_tokens belong to the decode leg: a prefill leg with n 3 or min_tokens 5 (above its
    max_tokens 1) was refused with a 400, so such requests failed through the router."""
    body = {"prompt": " ".join(["word"] * 40), "max_tokens": 12, "n": 3, "best_of": 3, "min_tokens": 5,
            "temperature": 0.9, "seed": 4}
    answer, seen = serve(body)
    assert answer.status_code == 200
    prefill_leg, decode_leg = seen[1][1], seen[2][1]
    assert prefill_leg == {"prompt": body["prompt"], "max_tokens": 1, "n": 1, "temperature": 0.9, "seed": 4,
                           "stream": False, "kv_transfer_params": prefill_leg["kv_transfer_params"]}
    assert decode_leg == {**body, "kv_transfer_params": KV}


def test_batched_prompts_and_prompt_logprobs_go_straight_to_decode():
    """A prefill leg holds one prompt's KV, and prompt logprobs need every position computed on the decode
    side: such bodies were sent to the prefill server (its held blocks wasted until lease expiry) and the
    decode server answered 400 to prompt logprobs."""
    long = " ".join(["word"] * 40)
    for body in ({"prompt": [long, long + " two"], "max_tokens": 4}, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4},
                 {"prompt": long, "max_tokens": 4, "prompt_logprobs": 1},
                 {"prompt": long, "max_tokens": 4, "echo": True, "logprobs": 1},
                 {"prompt": long, "max_tokens": 0, "echo": True}):
        answer, seen = serve(body)
        assert answer.status_code == 200 and seen == [(f"{DECODE}/v1/completions", body)], body
    answer, seen = serve({"prompt": list(range(40)), "max_tokens": 4, "echo": True})  # NOTE: one token-id prompt
    assert [url for url, _ in seen] == [f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions"]


def test_a_prefill_server_answering_503_lets_decode_prefill():
    """A prefill server whose engine core died answers 503 while it restarts: that 503 was the client's answer
    although the decode server could serve the request alone."""
    body = {"prompt": " ".join(["word"] * 40), "max_tokens": 12}
    answer, seen = serve(body, prefill_status=503)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decoded"
    assert seen[-1] == (f"{DECODE}/v1/completions", body)


def test_a_connect_timeout_is_tried_once_more_on_each_leg():
    """256 concurrent streams through the router: 11-23 of them were 502 ``decode_unreachable`` (and more took
    the decode-only path) after a 2 s loopback connect timeout while the router's loop was busy."""
    body = {"prompt": " ".join(["word"] * 40), "max_tokens": 12}
    answer, seen = serve(body, connect_timeouts=1)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decoded"
    assert [url for url, _ in seen] == [f"{DECODE}/tokenize", f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions"]
    assert seen[-1][1]["kv_transfer_params"] == KV
    answer, _ = serve(body, connect_timeouts=2)
    assert answer.status_code == 502 and answer.json()["error"]["message"] == (
        f"the decode server {DECODE} is unreachable: ConnectTimeout")


def test_an_ejected_server_is_skipped_until_its_half_open_trial():
    other = "http://decode-2:8200"
    proxy = PDProxy(PDConfig(prefill=(PREFILL,), decode=(DECODE, other)), httpx.AsyncClient())
    assert proxy.choose(proxy.decode) == DECODE  # a tie goes to the first listed
    proxy.health[DECODE].on_connect_error("ConnectError: refused")
    assert proxy.choose(proxy.decode) == other and proxy.health[DECODE].state is HealthState.EJECTED
    proxy.health[DECODE].ejected_until = 0.0  # its ejection time is up: the next request is its trial
    assert proxy.choose(proxy.decode) == DECODE and proxy.health[DECODE].state is HealthState.HALF_OPEN
    proxy.health[DECODE].on_failure("sent no response byte within 1 s")  # the trial failed: out again, longer
    assert proxy.health[DECODE].state is HealthState.EJECTED and proxy.health[DECODE].backoff_s == 4.0
    proxy.health[other].on_connect_error("ConnectError: refused")
    assert proxy.choose(proxy.decode) == DECODE  # every one ejected: all of them are tried
    assert proxy.choose(proxy.decode, exclude=[DECODE, other]) is None


def test_an_ejected_prefill_server_is_skipped_until_its_ejection_ends():
    """The only prefill server hangs: once ejected, requests went to it anyway (every server ejected: all
    of them tried) and each waited the first-byte timeout before the decode server prefilled itself."""
    seen: list[str] = []
    hang = asyncio.Event()

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if str(request.url).startswith(PREFILL):
            await hang.wait()
        return httpx.Response(200, json={"choices": [{"text": "decoded"}], "kv_transfer_params": None})

    body = {"prompt": " ".join(["word"] * 40), "max_tokens": 12}

    async def main() -> list[int]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        proxy = PDProxy(PDConfig(prefill=(PREFILL,), decode=(DECODE,), first_byte_timeout_s=0.2,
                                 failure_threshold=1), client)
        statuses = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_pd_app(proxy)),
                                     base_url="http://router") as router:
            for _ in range(3):
                statuses.append((await router.post("/v1/completions", json=body)).status_code)
            assert proxy.health[PREFILL].state is HealthState.EJECTED
            assert (proxy.num_prefill_unreachable, proxy.num_first_byte_timeouts) == (3, 1)
            proxy.health[PREFILL].ejected_until = 0.0  # its ejection time is up: the next request is its trial
            hang.set()
            statuses.append((await router.post("/v1/completions", json=body)).status_code)
            assert proxy.health[PREFILL].state is HealthState.HEALTHY and proxy.num_disaggregated == 1
        return statuses

    assert asyncio.run(main()) == [200] * 4
    assert seen == [f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions", f"{DECODE}/v1/completions",
                    f"{DECODE}/v1/completions", f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions"]


def _pd_answers(requests: list[tuple[str, str, dict | str | None]], down: set[str] = frozenset(),
                decode: tuple[str, ...] = (DECODE,)) -> tuple[list[httpx.Response], list[str]]:
    """Sends each (method, path, body) through a PDProxy whose servers answer 200 unless in ``down``
    (refused connections); returns the answers and the upstream URLs asked."""
    seen: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if f"{request.url.scheme}://{request.url.host}:{request.url.port}" in down:
            raise httpx.ConnectError("connection refused")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": request.url.host}]})
        return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": None})

    async def main() -> list[httpx.Response]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        proxy = PDProxy(PDConfig(prefill=(PREFILL,), decode=decode), client)
        json_type = {"content-type": "application/json"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_pd_app(proxy)),
                                     base_url="http://router") as router:
            return [await router.request(method, path, content=body, headers=json_type)
                    for method, path, body in requests]

    return asyncio.run(main()), seen


def test_bad_bodies_are_400_in_openai_shape_and_reach_no_server():
    """A body nested 5000 deep (RecursionError) and NaN / Infinity sampling values (the legs' JSON could not
    carry them: "Out of range float values are not JSON compliant") were 500 Internal Server Error."""
    deep = "[" * 5000 + "]" * 5000
    answers, seen = _pd_answers([("POST", "/v1/completions", f'{{"model": "m", "prompt": {deep}}}'),
                                 ("POST", "/v1/completions", '{"prompt": "p", "temperature": NaN}'),
                                 ("POST", "/v1/chat/completions", '{"messages": [], "top_p": Infinity}'),
                                 ("POST", "/v1/completions", '{"prompt": "p", "logit_bias": {"5": -Infinity}}')])
    assert [(a.status_code, a.json()["error"]["message"], a.json()["error"]["param"]) for a in answers] == [
        (400, "the body is not valid JSON: nested too deeply", None),
        (400, "temperature: Input should be a finite number", "temperature"),
        (400, "top_p: Input should be a finite number", "top_p"),
        (400, "logit_bias: Input should be a finite number", "logit_bias")]
    assert all(a.json()["error"]["type"] == "invalid_request_error" for a in answers) and seen == []


def test_models_asks_the_next_decode_server_when_the_first_is_unreachable():
    other = "http://decode-2:8200"
    answers, seen = _pd_answers([("GET", "/v1/models", None)], down={DECODE}, decode=(DECODE, other))
    assert answers[0].status_code == 200 and answers[0].json()["data"] == [{"id": "decode-2"}]
    assert seen == [f"{DECODE}/v1/models", f"{other}/v1/models"]
    answers, _ = _pd_answers([("GET", "/v1/models", None)], down={DECODE})
    assert (answers[0].status_code, answers[0].headers["retry-after"], answers[0].json()) == (502, "1", {"error": {
        "message": f"no decode server answered /v1/models: {DECODE}: ConnectError: connection refused",
        "type": "bad_gateway", "param": None, "code": "decode_unreachable"}})


def test_a_body_nested_near_the_recursion_limit_is_a_400_not_a_500_on_the_legs():
    """Read at 990 levels, such a body failed in the legs' JSON encoder (RecursionError: 500)."""
    def nested(levels: int) -> str:
        return f'{{"prompt": "p", "max_tokens": 2, "x": {"[" * levels + "]" * levels}}}'

    answers, seen = _pd_answers([("POST", "/v1/completions", nested(990)), ("POST", "/v1/completions", nested(255)),
                                 ("POST", "/v1/completions", nested(256))])
    assert [a.status_code for a in answers] == [400, 200, 400]
    assert answers[2].json()["error"] == {"message": "the body is not valid JSON: nested too deeply (more than 256 "
                                          "levels)", "type": "invalid_request_error", "param": "x", "code": None}
    assert seen == [f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions"]  # the 255-level body only



@pytest.mark.parametrize("content", [b"<html>ok</html>", b"[1, 2]"])
def test_a_prefill_answer_that_is_not_a_json_object_lets_decode_prefill(content):
    """A 200 whose body is not a JSON object (a proxy's HTML page, a JSON list) was a 500."""
    seen: list[tuple[str, dict]] = []
    body = {"prompt": "p", "max_tokens": 2}

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), json.loads(request.content)))
        if str(request.url).startswith(PREFILL):
            return httpx.Response(200, content=content)
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    async def main() -> tuple[httpx.Response, PDProxy]:
        proxy = PDProxy(PDConfig(prefill=(PREFILL,), decode=(DECODE,)),
                        httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_pd_app(proxy)),
                                     base_url="http://router") as router:
            return await router.post("/v1/completions", json=body), proxy

    answer, proxy = asyncio.run(main())
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "decoded"
    assert seen[-1] == (f"{DECODE}/v1/completions", body)  # the client's own body: it prefills itself
    assert (proxy.num_prefill_unreachable, proxy.health[PREFILL].consecutive_failures) == (1, 1)
