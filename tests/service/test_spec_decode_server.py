"""`tandem serve` with a real draft model: same completions as the plain engine, spec-decode metrics."""

from __future__ import annotations

import httpx
from live_server import Server, metric_samples, wait_idle

from tandem import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The little dog"]


def test_speculating_server_matches_offline_plain_and_exports_metrics(stories_dir, tmp_path):
    draft = stories_dir.parent / "drafts" / "ar"
    server = Server(stories_dir, tmp_path / "server.log", "--speculative-method", "draft",
                    "--speculative-model", str(draft), "--num-speculative-tokens", "4")
    plain = LLM(str(stories_dir), dtype="float32", progress=False, num_threads=1)
    try:
        server.wait_healthy()
        for prompt in PROMPTS:
            body = {"model": str(stories_dir), "prompt": prompt, "max_tokens": 40, "temperature": 0.0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0)
            assert response.status_code == 200, response.text
            expected = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
            assert response.json()["choices"][0]["text"] == expected.text
        wait_idle(server.url)
        m = metric_samples(server.url)
        drafts = m[("tandem:spec_decode_num_drafts_total", ())]
        drafted = m[("tandem:spec_decode_num_draft_tokens_total", ())]
        accepted = m[("tandem:spec_decode_num_accepted_tokens_total", ())]
        per_pos = [m[("tandem:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))]
                   for p in range(4)]
        assert drafts > 0 and 0 < accepted <= drafted <= 4 * drafts
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    finally:
        assert server.stop() == 0, server.log()
