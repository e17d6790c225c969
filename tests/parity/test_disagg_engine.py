"""Disaggregated prefill/decode between two in-process engines over loopback TCP (stories260K, float32).

The prefill engine (kv_producer) and the decode engine (kv_consumer) each run a ``TandemConnector``;
the test steps both engines in turn (the producer serves pulls between its steps), and compares the
decode side's tokens with a co-located engine's.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path

import pytest

from tandem.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.disagg.consumer import KVPuller
from tandem.engine.core import EngineCore
from tandem.models.resolve import resolve_model_path
from tandem.request import Request
from tandem.sampling_params import SamplingParams

BLOCK = 4
PROMPT = [(7 * i + 3) % 400 + 5 for i in range(37)]  # 37 tokens: 9 full blocks + 1 token
OTHER = [(11 * i + 5) % 400 + 5 for i in range(37)]  # shares no block with PROMPT
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(model: Path, role: str | None = None, *, dtype: str = "float32", block_size: int = BLOCK,
           chunk: int = 0, speculative: SpeculativeConfig | None = None, prefix_caching: bool = True,
           **kv: object) -> EngineCore:
    transfer = None
    if role is not None:
        kv.setdefault("kv_port", free_port())
        transfer = KVTransferConfig(kv_role=role, **kv)
    config = EngineConfig(model=ModelConfig(model=str(model), dtype=dtype),
                          cache=CacheConfig(block_size=block_size, num_blocks=64,
                                            enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(long_prefill_token_threshold=chunk), kv_transfer=transfer,
                          speculative=speculative)
    return EngineCore(model, config, progress=False)


def run(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams, *others: EngineCore,
        timeout_s: float = 20.0) -> tuple[list[int], dict | None]:
    """Adds the request, steps ``core`` (and ``others``) until it finishes: (tokens, kv_transfer_params),
    or ``([], {"failed": why})`` when the connector ended it."""
    core.add_request(Request(rid, list(prompt), params, max_tokens=params.max_tokens))
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for other in others:
            other.step()
        for out in core.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens, out.kv_transfer_params
        failed = {fid: why for fid, why, _ in core.take_failed_requests()}
        if rid in failed:
            return [], {"failed": failed[rid]}
        time.sleep(0.0005)
    raise AssertionError(f"request {rid} did not finish in {timeout_s} s")


def prefill(producer: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    leg = dataclasses.replace(params, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    tokens, kv_params = run(producer, rid, prompt, leg)
    assert len(tokens) == 1 and kv_params["do_remote_prefill"] is True
    return kv_params


def drain(*cores: EngineCore, steps: int = 50) -> None:
    for _ in range(steps):
        for core in cores:
            core.step()


@pytest.fixture(scope="module")
def engines(stories_dir):
    colocated = engine(stories_dir)
    producer = engine(stories_dir, "kv_producer", lease_ttl_s=30.0)
    consumer = engine(stories_dir, "kv_consumer", prefill_failure_policy="fail", transfer_timeout_s=2.0)
    yield colocated, producer, consumer
    producer.close()
    consumer.close()


def assert_clean(*cores: EngineCore) -> None:
    for core in cores:
        core.scheduler.check()
        assert core.scheduler.kv_cache_usage == 0.0
        assert core.scheduler.kv_cache_manager.num_held_blocks == 0


@pytest.mark.parametrize("length", [2, 5, 37])
def test_greedy_through_prefill_then_decode_equals_colocated(engines, length):
    colocated, producer, consumer = engines
    prompt = PROMPT[:length]
    params = SamplingParams(**GREEDY)
    expected, _ = run(colocated, f"c{length}", prompt, params)
    kv_params = prefill(producer, f"p{length}", prompt, params)
    assert kv_params["remote_port"] == producer.kv_connector.config.kv_port
    assert len(kv_params["remote_block_ids"]) == -(-length // BLOCK)
    got, outcome = run(consumer, f"d{length}", prompt, dataclasses.replace(params, kv_transfer_params=kv_params),
                       producer)
    assert got == expected
    assert outcome["remote_prefill"] == "pulled"
    drain(producer, consumer)
    assert_clean(producer, consumer)


def test_local_prefix_hit_pulls_only_the_rest_and_seeded_sampling_matches(engines):
    colocated, producer, consumer = engines
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=8, ignore_eos=True)
    expected, _ = run(colocated, "seeded-c", OTHER, params)
    first = prefill(producer, "seeded-p1", OTHER[:21], params)  # decode then caches 5 full blocks
    run(consumer, "seeded-d1", OTHER[:21], dataclasses.replace(params, kv_transfer_params=first), producer)
    kv_params = prefill(producer, "seeded-p2", OTHER, params)
    got, outcome = run(consumer, "seeded-d2", OTHER, dataclasses.replace(params, kv_transfer_params=kv_params),
                       producer)
    assert got == expected
    assert outcome["num_local_hit_tokens"] == 20
    assert outcome["num_pulled_blocks"] == 9 - 5  # blocks 5..8 hold tokens 20..35
    drain(producer, consumer)
    assert_clean(producer, consumer)


def test_chunked_prefill_on_the_producer(stories_dir, engines):
    colocated, _, consumer = engines
    producer = engine(stories_dir, "kv_producer", chunk=8)
    try:
        params = SamplingParams(**GREEDY)
        prompt = [t + 1 for t in OTHER]  # not cached on the decode side: all 9 blocks come from the producer
        expected, _ = run(colocated, "chunk-c", prompt, params)
        kv_params = prefill(producer, "chunk-p", prompt, params)
        got, outcome = run(consumer, "chunk-d", prompt, dataclasses.replace(params, kv_transfer_params=kv_params),
                           producer)
        assert got == expected and outcome["num_pulled_blocks"] == 9
        drain(producer, consumer)
        assert_clean(producer, consumer)
    finally:
        producer.close()


def test_dead_decode_side_blocks_come_back_at_lease_expiry(stories_dir):
    producer = engine(stories_dir, "kv_producer", lease_ttl_s=0.2)
    try:
        prefill(producer, "orphan", PROMPT, SamplingParams(**GREEDY))
        assert producer.scheduler.kv_cache_manager.num_held_blocks == 10  # no decode side ever pulls
        time.sleep(0.25)
        producer.step()
        assert_clean(producer)
    finally:
        producer.close()


@pytest.mark.parametrize("policy", ["fail", "local"])
def test_expired_lease_and_reused_blocks_are_never_read(stories_dir, engines, policy):
    colocated, _, _ = engines
    producer = engine(stories_dir, "kv_producer", lease_ttl_s=0.2)
    consumer = engine(stories_dir, "kv_consumer", prefill_failure_policy=policy, transfer_timeout_s=2.0)
    try:
        params = SamplingParams(**GREEDY)
        prompt = [t + 2 for t in OTHER]
        expected, _ = run(colocated, f"lease-c-{policy}", prompt, params)
        stale = prefill(producer, f"lease-p-{policy}", prompt, params)
        time.sleep(0.25)
        run(producer, f"reuse-{policy}", PROMPT, params)  # expires the lease and reuses its blocks
        got, outcome = run(consumer, f"lease-d-{policy}", prompt,
                           dataclasses.replace(params, kv_transfer_params=stale), producer)
        if policy == "fail":
            assert got == [] and "unknown or expired" in outcome["failed"]
        else:
            assert got == expected and outcome["remote_prefill"] == "local_fallback"
        # a live lease with a stale generation (the block was reused) is refused as well
        live = prefill(producer, f"gen-p-{policy}", prompt, params)
        forged = {**live, "remote_block_generations": [g - 1 for g in live["remote_block_generations"]]}
        got, outcome = run(consumer, f"gen-d-{policy}", [t + 3 for t in OTHER],
                           dataclasses.replace(params, kv_transfer_params={**forged, "remote_prompt_digest": None}),
                           producer)
        reason = outcome["failed"] if policy == "fail" else outcome["reason"]
        assert "freed and reused" in reason
        assert producer.stats().kv_transfer["pull_errors_served"] == 2
        time.sleep(0.25)
        drain(producer, consumer)
        assert_clean(producer, consumer)
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize(("change", "expected"), [
    ({"block_size": 8}, "block size 4 != 8"),
    ({"dtype": "bfloat16"}, "dtype float32 != bfloat16"),
    ({"secret": "not-the-secret"}, "wrong or missing KV transfer secret"),
])
def test_handshake_mismatches_are_clear_errors(stories_dir, engines, change, expected):
    _, producer, _ = engines
    kv = {"secret": change.pop("secret")} if "secret" in change else {}
    secured = engine(stories_dir, "kv_producer", secret="the-secret") if kv else producer
    consumer = engine(stories_dir, "kv_consumer", prefill_failure_policy="fail", **change, **kv)
    try:
        refused = secured.stats().kv_transfer["peers_refused"]
        params = SamplingParams(**GREEDY)
        kv_params = prefill(secured, "hs-p", PROMPT, params)
        got, outcome = run(consumer, "hs-d", PROMPT, dataclasses.replace(params, kv_transfer_params=kv_params),
                           secured)
        assert got == [] and expected in outcome["failed"], outcome
        assert secured.stats().kv_transfer["peers_refused"] == refused + 1  # one decode leg, one refusal
        drain(consumer)
        assert_clean(consumer)
        secured.scheduler.kv_cache_manager.release(kv_params["remote_lease_id"])
        assert_clean(secured)
    finally:
        consumer.close()
        if secured is not producer:
            secured.close()


@pytest.mark.parametrize("policy", ["fail", "local"])
def test_unreachable_producer(stories_dir, engines, policy):
    colocated = engines[0]
    producer = engine(stories_dir, "kv_producer")
    consumer = engine(stories_dir, "kv_consumer", prefill_failure_policy=policy, transfer_timeout_s=0.3)
    try:
        params = SamplingParams(**GREEDY)
        prompt = [t + 4 for t in OTHER]
        expected, _ = run(colocated, f"gone-c-{policy}", prompt, params)
        kv_params = prefill(producer, f"gone-p-{policy}", prompt, params)
        producer.close()  # the prefill server is gone before the decode side pulls
        got, outcome = run(consumer, f"gone-d-{policy}", prompt,
                           dataclasses.replace(params, kv_transfer_params=kv_params))
        if policy == "fail":
            assert got == [] and "sent nothing for 0.3 s" in outcome["failed"]
        else:
            assert got == expected and outcome["remote_prefill"] == "local_fallback"
            assert consumer.stats().kv_transfer["local_prefills"] == 1
        drain(consumer)
        assert_clean(consumer)
    finally:
        consumer.close()


def test_aborts_on_either_side_free_both_sides(engines):
    _, producer, consumer = engines
    params = SamplingParams(**GREEDY)
    producer.add_request(Request("abort-p", list(PROMPT), dataclasses.replace(
        params, max_tokens=1, kv_transfer_params={"do_remote_decode": True}), max_tokens=1))
    producer.abort_requests(["abort-p"])  # the prefill leg's client went away
    kv_params = prefill(producer, "abort-p2", PROMPT, params)
    consumer.add_request(Request("abort-d", list(PROMPT), dataclasses.replace(params, kv_transfer_params=kv_params),
                                 max_tokens=8))
    consumer.abort_requests(["abort-d"])  # the decode leg's client went away while its KV was on the wire
    deadline = time.monotonic() + 10  # NOTE: the pull ends on the puller's thread, then its release travels
    while time.monotonic() < deadline and producer.scheduler.kv_cache_manager.num_held_blocks:
        drain(producer, consumer, steps=1)
        time.sleep(0.001)
    drain(producer, consumer)
    assert_clean(producer, consumer)


def test_draft_model_kv_travels_with_speculation(stories_dir, engines):
    colocated = engines[0]
    spec = SpeculativeConfig(method="self-quant", num_speculative_tokens=3)
    producer = engine(stories_dir, "kv_producer", speculative=spec)
    consumer = engine(stories_dir, "kv_consumer", prefill_failure_policy="fail", speculative=spec)
    try:
        assert len(producer.runner.kv_cache_groups()) == 2  # the draft model's cache travels too
        params = SamplingParams(**GREEDY)
        prompt = [t + 5 for t in OTHER]
        expected, _ = run(colocated, "spec-c", prompt, params)
        kv_params = prefill(producer, "spec-p", prompt, params)
        got, outcome = run(consumer, "spec-d", prompt, dataclasses.replace(params, kv_transfer_params=kv_params),
                           producer)
        assert got == expected and outcome["remote_prefill"] == "pulled"
        assert consumer.stats().spec_num_drafts > 0
        drain(producer, consumer)
        assert_clean(producer, consumer)
    finally:
        producer.close()
        consumer.close()


def test_a_decode_leg_naming_an_unlisted_producer_is_refused_before_any_connection(engines):
    _, producer, consumer = engines
    params = SamplingParams(**GREEDY)
    kv_params = prefill(producer, "ssrf-p", PROMPT, params)
    before = consumer.stats().kv_transfer["remote_hosts_refused"]
    for host, port in (("169.254.169.254", 80), ("10.0.0.5", kv_params["remote_port"])):
        forged = {**kv_params, "remote_host": host, "remote_port": port}
        with pytest.raises(ValueError, match=f"remote_host '{host}' \\(port {port}\\) is not an allowed prefill"):
            consumer.add_request(Request(f"ssrf-{host}", list(PROMPT),
                                         dataclasses.replace(params, kv_transfer_params=forged), max_tokens=8))
    assert consumer.stats().kv_transfer["remote_hosts_refused"] == before + 2
    assert not {host for host, _ in consumer.kv_connector.puller._peers} - {"127.0.0.1"}  # never connected
    producer.scheduler.kv_cache_manager.release(kv_params["remote_lease_id"])
    assert_clean(producer, consumer)


class _Killed(Exception):
    pass


class DiesMidStream:
    """Steps a prefill engine whose process "dies" while it streams a pull: after ``layers`` layers (K and V
    each) its data connection closes, as a killed process's kernel closes it, and so does the engine."""

    def __init__(self, core: EngineCore, layers: int) -> None:
        self.core, self.dead, self.closed = core, False, False
        data = core.kv_connector.server.data
        send, sent = data._send_frame, []

        def dying_send(sock: object, frame: object, staging: object) -> int:
            if len(sent) == 2 * layers:
                self.dead = True
                raise _Killed  # NOTE: the channel closes the connection on any failure
            sent.append(1)
            return send(sock, frame, staging)

        data._send_frame = dying_send

    def step(self) -> None:
        if self.closed:
            return
        self.core.step()
        if self.dead:
            self.closed = True
            self.core.close()


@pytest.mark.parametrize("policy", ["fail", "local"])
def test_producer_killed_in_the_middle_of_a_layer_stream(stories_dir, engines, monkeypatch, policy):
    colocated = engines[0]
    producer = engine(stories_dir, "kv_producer")
    consumer = engine(stories_dir, "kv_consumer", prefill_failure_policy=policy, transfer_timeout_s=30.0)
    frames: list[int] = []
    recv_frame = KVPuller._recv_frame
    monkeypatch.setattr(KVPuller, "_recv_frame", lambda self, *a: (n := recv_frame(self, *a), frames.append(n))[0])
    try:
        assert len(producer.runner.kv_caches) > 2
        params = SamplingParams(**GREEDY)
        prompt = [t + 6 for t in OTHER]
        expected, _ = run(colocated, f"kill-c-{policy}", prompt, params)
        kv_params = prefill(producer, f"kill-p-{policy}", prompt, params)
        dying = DiesMidStream(producer, layers=2)
        t0 = time.monotonic()
        got, outcome = run(consumer, f"kill-d-{policy}", prompt,
                           dataclasses.replace(params, kv_transfer_params=kv_params), dying)
        assert time.monotonic() - t0 < 15  # NOTE: the closed connection fails the pull, not the 30 s timeout
        assert dying.dead and len(frames) == 4  # K and V of 2 layers arrived, then the producer died
        why = "the prefill engine closed the KV data connection after 0 of"
        if policy == "fail":
            assert got == [] and why in outcome["failed"]
        else:
            assert got == expected and outcome["remote_prefill"] == "local_fallback"
            assert why in outcome["reason"]
        assert consumer.stats().kv_transfer["pull_failures"] == 1
        consumer.on_idle()  # the idle-time integrity check
        drain(consumer)
        assert_clean(consumer)
    finally:
        producer.close()
        consumer.close()


@pytest.mark.usefixtures("smollm2_available")
def test_default_model_in_bf16_through_prefill_then_decode_equals_one_server():
    model = resolve_model_path(None)
    # NOTE: no prefix caching, so the reference, the prefill leg and the decode leg each compute their own KV
    producer = engine(model, "kv_producer", dtype="bfloat16", block_size=16, prefix_caching=False)
    consumer = engine(model, "kv_consumer", dtype="bfloat16", block_size=16, prefix_caching=False,
                      prefill_failure_policy="fail")
    try:
        params = SamplingParams(**GREEDY)
        prompt = PROMPT  # 37 tokens: 2 full blocks + 5 tokens
        expected, _ = run(producer, "bf16-c", prompt, params)  # one server: prefill and decode together
        kv_params = prefill(producer, "bf16-p", prompt, params)
        got, outcome = run(consumer, "bf16-d", prompt, dataclasses.replace(params, kv_transfer_params=kv_params),
                           producer)
        assert outcome["remote_prefill"] == "pulled" and outcome["num_pulled_blocks"] == 3
        assert got == expected and len(got) == 8
        drain(producer, consumer)
        assert_clean(producer, consumer)
    finally:
        producer.close()
        consumer.close()
