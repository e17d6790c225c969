"""`tandem bench offline`: throughput arithmetic on a fake clock, then both real backends on the
stories260K checkpoint."""

from __future__ import annotations

import json

import pytest

from tandem.bench import offline
from tandem.bench.cli import main


def test_throughput_arithmetic_on_a_fake_clock(monkeypatch):
    """A fake backend that 'takes' 0.4 s of prefill plus 0.1 s per further token."""
    clock = [0.0]
    monkeypatch.setattr(offline.time, "perf_counter", lambda: clock[0])
    calls = []

    def generate(prompts, max_tokens):
        calls.append((len(prompts), max_tokens))
        clock[0] += 0.4 + 0.1 * (max_tokens - 1)
        return [max_tokens] * len(prompts)

    prompts = [[5] * 16] * 4
    r = offline.measure("fake", generate, prompts, output_len=11, num_iters=3)
    assert calls == [(4, 2)] + [(4, 1)] * 3 + [(4, 11)] * 3  # warm-up, prefills, full runs
    assert r.prefill_s == pytest.approx(0.4)
    assert r.total_s == pytest.approx(1.4)
    assert r.prefill_tok_s == pytest.approx(4 * 16 / 0.4)
    assert r.decode_tok_s == pytest.approx(4 * 10 / 1.0)  # tokens after the first / (total - prefill)
    assert r.output_tok_s == pytest.approx(44 / 1.4)
    assert r.total_tok_s == pytest.approx(4 * 27 / 1.4)
    assert r.generated_tokens == 44

    with pytest.raises(ValueError, match="stopped after"):
        offline.measure("eos", lambda p, n: [min(n, 3)] * len(p), prompts, output_len=5)


def test_random_prompt_ids_are_exact_and_ordinary(stories_dir):
    from tandem.bench.datasets import load_tokenizer

    tok = load_tokenizer(str(stories_dir))
    ids = offline.random_prompt_ids(tok, batch_size=3, input_len=50, seed=0)
    assert [len(p) for p in ids] == [50, 50, 50]
    assert not set(tok.all_special_ids) & {i for p in ids for i in p}


@pytest.mark.parametrize("backend", ["hf", "tandem", "both"])
def test_offline_cli_on_stories260k(stories_dir, tmp_path, capsys, backend):
    out = tmp_path / "offline.json"
    code = main(["bench", "offline", "--model", str(stories_dir), "--input-len", "16", "--output-len", "8",
                 "--batch-size", "2", "--backend", backend, "--dtype", "float32", "--save-result", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    names = ["tandem", "hf"] if backend == "both" else [backend]
    assert [r["backend"] for r in rows] == names
    for r in rows:
        assert r["generated_tokens"] == 2 * 8
        assert r["prefill_tok_s"] * r["prefill_s"] == pytest.approx(2 * 16)
        # NOTE: no timing comparison: on a busy box a full run can time shorter than its prefill,
        # which the tool reports as "-" (None) rather than a negative rate.
        assert r["decode_tok_s"] is None or r["decode_tok_s"] > 0
    table = capsys.readouterr().out
    assert "| backend | prefill_tok_s |" in table
    assert ("| tandem/hf |" in table) == (backend == "both")


def test_offline_rejects_bad_lengths_before_generating(stories_dir, capsys, monkeypatch):
    def no_measure(*args, **kwargs):
        raise AssertionError("measured although the lengths cannot fit")

    monkeypatch.setattr(offline, "measure", no_measure)
    for backend in ("tandem", "hf"):
        code = main(["bench", "offline", "--model", str(stories_dir), "--input-len", "500", "--output-len", "100",
                     "--batch-size", "1", "--backend", backend, "--dtype", "float32"])
        assert code == 2
        assert f"{backend}: input 500 + output 100 > context 512" in capsys.readouterr().err
    assert main(["bench", "offline", "--output-len", "0"]) == 2  # checked before any model is loaded
    assert "--output-len must be >= 1, got 0" in capsys.readouterr().err
    offline.check_context("x", 400, 112, 512)  # exactly the context fits
    offline.check_context("x", 10_000, 1, None)  # unknown context: not checked
