"""Structured output without a model: the bitmask layout, masks before and during speculation, the
sampler and the verifier under a grammar, the edge's checks. Grammars are real llguidance matchers
over stories260K's 512-token vocabulary; logits are random, so only the grammar keeps text valid."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch
from transformers import AutoTokenizer

from tandem.sample import ops
from tandem.sample.grammar import Grammar, GrammarCompiler, allocate_bitmask, fill_bitmask, make_tokenizer
from tandem.sample.sampler import Sampler, SamplingState
from tandem.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from tandem.spec_decode.rejection import VerifyRow, verify_batch
from tandem.structured_outputs import check_grammar, grammar_text

EOS = frozenset({2})
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["cat", "dog"]}, "n": {"type": "integer"}},
          "required": ["k", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf_tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(str(stories_dir))


@pytest.fixture(scope="module")
def lltok(hf_tokenizer):
    return make_tokenizer(hf_tokenizer, 512, EOS)


def grammar(lltok, **constraint) -> Grammar:
    text = grammar_text(StructuredOutputsParams(**constraint))
    return Grammar(llguidance.LLMatcher(lltok, text, log_level=0))


def allowed(bitmask_row: torch.Tensor, vocab: int = 512) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_apply_token_bitmask_matches_a_per_token_loop():
    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 2), dtype=torch.int32)
    logits = torch.randn(3, 50)
    expected = logits.clone()
    for r in range(3):
        for t in range(50):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    assert torch.equal(ops.apply_token_bitmask(logits.clone(), bitmask), expected)
    with torch.inference_mode():  # as in the runner
        assert torch.equal(ops.apply_token_bitmask(logits.clone(), bitmask), expected)
    bf16 = logits.bfloat16()  # the torch path (not a float32 array numpy can fill)
    assert torch.equal(ops.apply_token_bitmask(bf16.clone(), bitmask), expected.bfloat16())
    for some in (logits.clone(), bf16.clone()):  # bitmask rows 0 and 1 mask logits rows 2 and 0
        ops.apply_token_bitmask(some, bitmask[:2], [2, 0])
        want = torch.stack([expected_row(logits[0], bitmask[1]), logits[1], expected_row(logits[2], bitmask[0])])
        assert torch.equal(some, want.to(some.dtype))
    wide = torch.zeros(1, 70)  # a vocabulary wider than 32 * words: the tail is forbidden
    ops.apply_token_bitmask(wide, torch.full((1, 2), -1, dtype=torch.int32))
    assert torch.isinf(wide[0, 64:]).all() and (wide[0, :64] == 0).all()


def expected_row(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits [V]`` with -inf wherever bit t of ``words`` is clear, one token at a time."""
    out = logits.clone()
    for t in range(out.shape[0]):
        if not (int(words[t // 32]) >> (t % 32)) & 1:
            out[t] = float("-inf")
    return out


def test_masks_after_drafts_equal_masks_after_consuming_them(lltok):
    g = grammar(lltok, choice=["cat", "dog"])
    drafts = lltok.tokenize_str("cat")
    bitmask = allocate_bitmask(len(drafts) + 1, 512)
    fill_bitmask([g], bitmask, [drafts])
    reference = grammar(lltok, choice=["cat", "dog"])
    for j in range(len(drafts) + 1):
        step = allocate_bitmask(1, 512)
        fill_bitmask([reference], step)
        assert allowed(bitmask[j]) == allowed(step[0])
        if j < len(drafts):
            reference.accept([drafts[j]])
    assert allowed(bitmask[-1]) == {2}  # complete: only EOS
    fresh = allocate_bitmask(1, 512)
    fill_bitmask([g], fresh)  # the matcher was rolled back to where it started
    assert allowed(fresh[0]) == allowed(bitmask[0])


def test_invalid_draft_leaves_later_rows_untouched_and_is_rejected(lltok):
    g = grammar(lltok, regex="[0-9]{2}")
    digit, letter = lltok.tokenize_str("5")[-1], lltok.tokenize_str("a")[-1]
    bitmask = allocate_bitmask(3, 512)
    fill_bitmask([g], bitmask, [[letter, digit]])
    assert letter not in allowed(bitmask[0]) and (bitmask[1:] == -1).all()
    logits = torch.zeros(3, 512)
    logits[0, letter] = 10.0  # the model prefers the forbidden draft
    state = SamplingState.create(SamplingParams(temperature=0.0), [1], [], EOS)
    state.grammar = g
    (result,) = verify_batch(logits, [VerifyRow(state, [letter, digit])])
    assert len(result.token_ids) == 1 and result.token_ids[0] != letter
    assert lltok.decode_str(result.token_ids).strip().isdigit()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_keeps_random_logits_inside_the_schema(lltok, temperature):
    sampler = Sampler()
    torch.manual_seed(1)
    states = []
    for seed in range(4):
        s = SamplingState.create(SamplingParams(temperature=temperature, seed=seed), [1], [], EOS)
        s.grammar = grammar(lltok, json=SCHEMA, disable_any_whitespace=True)
        states.append(s)
    plain = SamplingState.create(SamplingParams(temperature=temperature, seed=9), [1], [], EOS)
    states.append(plain)  # a row without a grammar in the same batch stays unconstrained
    for _ in range(60):
        live = [s for s in states if s is plain or not (s.output_token_ids and s.output_token_ids[-1] == 2)]
        out = sampler(torch.randn(len(live), 512) * 3, live)
        for s, token in zip(live, out.token_ids, strict=True):
            s.append([token])
    for s in states[:4]:
        assert s.output_token_ids[-1] == 2, "the grammar completed and allowed only EOS"
        value = json.loads(lltok.decode_str(s.output_token_ids[:-1]))
        assert set(value) == {"k", "n"} and value["k"] in ("cat", "dog") and isinstance(value["n"], int)
    assert len(plain.output_token_ids) == 60


def test_min_tokens_does_not_forbid_the_only_token_a_complete_grammar_allows(lltok):
    s = SamplingState.create(SamplingParams(temperature=0.0, min_tokens=50, max_tokens=60), [1], [], EOS)
    s.grammar = grammar(lltok, choice=["dog"])
    s.append(lltok.tokenize_str("dog"))
    assert s.grammar.is_stopped() and s.min_tokens_blocked_ids() == []
    assert Sampler()(torch.randn(1, 512), [s]).token_ids == [2]


def test_compiler_caches_by_grammar_and_hands_out_independent_matchers(hf_tokenizer, lltok):
    compiler = GrammarCompiler(lambda: hf_tokenizer, 512)
    try:
        params = StructuredOutputsParams(choice=["a", "b"])
        first = compiler.submit(params, EOS).result(timeout=30)
        second = compiler.submit(params, EOS).result(timeout=30)
        assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 1)
        first.accept(lltok.tokenize_str("a"))
        assert first.is_stopped() and not second.is_stopped()
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "string"}}, "contains"),
    ({"not": {"type": "string"}}, "not"),
])
def test_unimplemented_schema_keyword_is_refused_by_name(schema, keyword):
    with pytest.raises(SamplingParamsError) as info:
        check_grammar(StructuredOutputsParams(json=schema), None, "response_format")
    assert info.value.param == "response_format"
    assert str(info.value) == f'the JSON schema cannot be enforced: Unimplemented keys: ["{keyword}"]'


def test_structured_outputs_params_are_validated():
    with pytest.raises(SamplingParamsError, match="exactly one of .* got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(SamplingParamsError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    for field, value in (("disable_any_whitespace", "yes"), ("disable_any_whitespace", 0), ("json_object", 1)):
        with pytest.raises(SamplingParamsError, match=f"structured_outputs.{field} has the wrong type"):
            StructuredOutputsParams(**{"regex": "a", field: value} if field != "json_object" else {field: value})
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})
    assert info.value.param == "structured_outputs"
    with pytest.raises(SamplingParamsError, match="invalid regex"):
        check_grammar(StructuredOutputsParams(regex="[a-"))
    with pytest.raises(SamplingParamsError, match="invalid structured_outputs.json"):
        grammar_text(StructuredOutputsParams(json="[1, 2]"))
    params = SamplingParams(structured_outputs={"choice": ["x"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["x"])
    assert StructuredOutputsParams(regex="a", disable_any_whitespace=None).disable_any_whitespace is False


def _nested_any_of(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


@pytest.mark.parametrize("json_field", ["[" * 5000 + "]" * 5000, {"type": "array", "items": _nested_any_of(450)}])
def test_too_deeply_nested_schema_is_a_request_error_not_a_crash(json_field):
    """Found over HTTP: both answered 500 ``RecursionError`` (json.loads of the string; the schema walk)."""
    with pytest.raises(SamplingParamsError, match="nested too deeply") as info:
        check_grammar(StructuredOutputsParams(json=json_field))
    assert info.value.param == "structured_outputs.json"


def test_a_grammar_too_large_to_compile_quickly_is_refused_before_llguidance_sees_it():
    """50,000 choices took 12.8 s of the API server's event loop (every other request waited)."""
    from tandem.structured_outputs import MAX_GRAMMAR_BYTES

    huge = StructuredOutputsParams(choice=[f"item number {i}" for i in range(50_000)])
    size = len(grammar_text(huge))
    with pytest.raises(SamplingParamsError) as e:
        check_grammar(huge)
    assert str(e.value) == (f"the choice cannot be enforced: its grammar is {size} bytes, more than the "
                            f"{MAX_GRAMMAR_BYTES} this server compiles")
    assert e.value.param == "structured_outputs"
    check_grammar(StructuredOutputsParams(choice=[f"item number {i}" for i in range(5_000)]))  # 104 KB: fine
