"""Speculative decoding config validation, CLI flags, counters and Prometheus series; model-free."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import add_engine_args, engine_config_from_args
from tandem.config import ConfigError, SpeculativeConfig
from tandem.engine.core_proc import CoreStats
from tandem.server.metrics import ServerMetrics
from tandem.spec_decode.metrics import SpecDecodeStats


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "medusa"}, "speculative method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be in"),
    ({"method": "draft"}, "needs speculative_model"),
    ({"method": "pard"}, "needs speculative_model"),
    ({"method": "ngram", "speculative_model": "x"}, "takes no speculative_model"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min <= ngram_max"),
    ({"ngram_min": 0}, "ngram_min <= ngram_max"),
    ({"method": "pard", "speculative_model": "x", "pard_mask_token_id": -1}, "pard_mask_token_id"),
    ({"method": "self-quant", "quantization": "fp8"}, "quantization must be one of"),
])
def test_invalid_config_raises(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(**kwargs)


def test_cli_flags_map_onto_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).speculative is None
    args = parser.parse_args(["--speculative-method", "pard", "--speculative-model", "/d", "--num-speculative-tokens",
                              "6", "--pard-mask-token-id", "0", "--ngram-min", "2", "--ngram-max", "5"])
    assert engine_config_from_args(args).speculative == SpeculativeConfig(
        method="pard", speculative_model="/d", num_speculative_tokens=6, pard_mask_token_id=0, ngram_min=2,
        ngram_max=5)
    args = parser.parse_args(["--speculative-method", "self-quant", "--speculative-quantization", "int4"])
    assert engine_config_from_args(args).speculative.quantization == "int4"


def test_spec_decode_stats():
    stats = SpecDecodeStats(3)
    assert stats.acceptance_rate == 0.0 and stats.mean_acceptance_length == 0.0
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(2, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0]
    assert stats.acceptance_rate == 0.5 and stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    with pytest.raises(ValueError):
        stats.observe(2, 3)
    with pytest.raises(ValueError):
        stats.observe(4, 1)


def test_prometheus_series_follow_the_core_counters():
    metrics = ServerMetrics("m")
    metrics.record_step(CoreStats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                                  spec_num_accepted_tokens_per_pos=[4, 2, 1]), 0)
    metrics.record_step(CoreStats(spec_num_drafts=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=9,
                                  spec_num_accepted_tokens_per_pos=[5, 3, 1]), 0)
    text = metrics.render().decode()
    assert 'tandem:spec_decode_num_drafts_total{instance_id="",model_name="m"} 5.0' in text
    assert 'tandem:spec_decode_num_draft_tokens_total{instance_id="",model_name="m"} 15.0' in text
    assert 'tandem:spec_decode_num_accepted_tokens_total{instance_id="",model_name="m"} 9.0' in text
    for pos, value in enumerate([5, 3, 1]):
        assert ('tandem:spec_decode_num_accepted_tokens_per_pos_total'
                f'{{instance_id="",model_name="m",position="{pos}"}} {value}.0') in text
