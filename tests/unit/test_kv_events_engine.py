"""KV events from a live engine (stories260K in this process, driven through ``EngineCoreProc``): the
blocks of a prompt are published as stored, evicted ones as removed, and the replay socket answers a
snapshot (the cached hashes) and a replay from seq 0 that matches what a subscriber received."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from tandem.config import CacheConfig, ConfigError, EngineConfig, KVEventsConfig, ModelConfig
from tandem.engine.core_proc import AddRequests, EngineCoreProc, OutputMessage, StepOutputs, WireRequest
from tandem.kv_cache.events import (
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    fetch_replay,
    fetch_snapshot,
    hash_from_bytes,
    parse_message,
)
from tandem.kv_cache.hashing import hash_token_blocks
from tandem.sampling_params import SamplingParams

BLOCK = 4
PROMPTS = [[10 + 7 * p + i for i in range(12)] for p in range(3)]  # three 12-token prompts: 3 full blocks each


def flat(batches):
    """(kind, hash) of every event, in order."""
    out = []
    for batch in batches:
        for e in batch.events:
            kind = type(e).__name__
            out += [(kind, hash_from_bytes(h)) for h in e.block_hashes] if not isinstance(e, AllBlocksCleared) \
                else [(kind, None)]
    return out


@pytest.fixture(scope="module")
def engine(stories_dir):
    from tandem.engine.core import EngineCore

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", topic="kv-events")
    config = EngineConfig(model=ModelConfig(model=str(stories_dir), dtype="float32"),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=6), num_threads=1, kv_events=events)
    core = EngineCore(stories_dir, config, progress=False)
    publisher = KVEventPublisher.from_config(events)
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://kv-test-out")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://kv-test-out")
    proc = EngineCoreProc(core, ctx.socket(zmq.PULL), push, 0, 0, publisher, "7")
    yield proc, pull, publisher
    publisher.close()
    for s in (pull, push, proc.inputs):
        s.close(linger=0)


def run_prompt(proc, pull, i: int) -> list[StepOutputs]:
    """Adds prompt ``i`` (greedy, 1 token) and steps until it finishes; returns the step messages."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    proc.handle(AddRequests(f"p{i}", [WireRequest(f"r{i}", PROMPTS[i], params, [], 1, time.monotonic())]))
    while proc.core.has_unfinished_requests():
        proc.step()
    decoder = msgspec.msgpack.Decoder(OutputMessage)
    messages = []
    while pull.poll(0):
        messages.append(decoder.decode(pull.recv()))
    return [m for m in messages if isinstance(m, StepOutputs)]


def test_engine_publishes_stored_then_removed_on_eviction_and_answers_snapshot(engine):
    proc, pull, publisher = engine
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(publisher.endpoint)
    time.sleep(0.3)  # NOTE: a late subscription only loses a prefix, which the replay below fills
    hashes = [hash_token_blocks(p, BLOCK) for p in PROMPTS]
    assert all(len(h) == 3 for h in hashes)
    in_band = [m.kv_events for i in range(3) for m in run_prompt(proc, pull, i) if m.kv_events is not None]
    # 6 blocks of 4: A and B take 3 fresh blocks each, so C evicts A's 3 cached blocks, the least
    # recently used first (a finished request's blocks are freed tail first, as in vLLM).
    stored = [("BlockStored", h) for h in hashes[0] + hashes[1]]
    events = flat(in_band)
    assert events[:6] == stored
    assert events[6:9] == [("BlockRemoved", h) for h in reversed(hashes[0])]
    assert events[9:] == [("BlockStored", h) for h in hashes[2]]
    assert {b.engine_id for b in in_band} == {"7"}
    assert all(e.block_size == BLOCK for b in in_band for e in b.events if isinstance(e, BlockStored))

    received = []
    while sub.poll(500):
        received.append(parse_message(sub.recv_multipart()))
    sub.close(linger=0)
    replayed = served(proc, fetch_replay, publisher.replay_endpoint, (0).to_bytes(8, "big"))
    assert [seq for seq, _ in replayed] == list(range(len(in_band)))
    assert [b for _, b in replayed] == in_band
    assert received and received == replayed[-len(received):]  # the subscriber saw a suffix, in order

    seq, snapshot = served(proc, fetch_snapshot, publisher.replay_endpoint)
    assert seq == len(in_band)
    assert isinstance(snapshot.events[0], AllBlocksCleared)
    assert sorted(hash_from_bytes(h) for h in snapshot.events[1].block_hashes) == sorted(hashes[1] + hashes[2])
    assert not any(isinstance(e, BlockRemoved) for e in snapshot.events)


def served(proc, fetch, *args):
    """``fetch(*args)`` in a thread while this one plays the engine loop's ``serve_kv_requests``."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fetch, *args)
        deadline = time.monotonic() + 10.0
        while not future.done() and time.monotonic() < deadline:
            proc.serve_kv_requests()
            time.sleep(0.01)
        return future.result()


def test_a_req_client_gets_one_answer_and_a_bad_request_only_the_end_marker(engine):
    proc, _, publisher = engine
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.connect(publisher.replay_endpoint)
    req.send(SNAPSHOT_REQUEST)
    deadline = time.monotonic() + 5.0
    while not req.poll(10) and time.monotonic() < deadline:
        proc.serve_kv_requests()
    frames = req.recv_multipart()
    assert len(frames) == 4 and int.from_bytes(frames[2], "big", signed=True) == -1 and frames[3] == b""
    req.close(linger=0)
    assert served(proc, fetch_replay, publisher.replay_endpoint, b"nonsense") == []


def test_kv_events_config_parses_vllm_json_and_shifts_ports_per_rank():
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5600", '
                                 '"topic": "kv-events"}')
    assert c.publishes and c.topic == "kv-events"
    assert c.for_rank(2).endpoint == "tcp://127.0.0.1:5559" and c.for_rank(2).replay_endpoint == "tcp://127.0.0.1:5602"
    assert KVEventsConfig(endpoint="tcp://127.0.0.1:*").for_rank(1).endpoint == "tcp://127.0.0.1:*"
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").for_rank(1).endpoint == "ipc:///tmp/kv-1"
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['enable'\]"):
        KVEventsConfig.from_json('{"enable": true}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVEventsConfig.from_json("{enable")
    with pytest.raises(ConfigError, match="publisher must be one of"):
        KVEventsConfig(publisher="kafka")
    with pytest.raises(ConfigError, match="must be a ZeroMQ address"):
        KVEventsConfig(endpoint="localhost:5557")


def test_an_endpoint_in_use_is_a_clear_error():
    first = KVEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match=f"cannot bind the KV events endpoint {first.endpoint}"):
            KVEventPublisher.from_config(KVEventsConfig(enable_kv_cache_events=True, endpoint=first.endpoint))
    finally:
        first.close()


def test_colliding_data_parallel_endpoints_are_refused():
    c = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:5557",
                       replay_endpoint="tcp://127.0.0.1:5558")
    c.check_ranks(1)
    with pytest.raises(ConfigError, match="engine 1's endpoint tcp://127.0.0.1:5558 is also engine 0's replay"):
        c.check_ranks(2)
    KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:5557",
                   replay_endpoint="tcp://127.0.0.1:5657").check_ranks(8)
