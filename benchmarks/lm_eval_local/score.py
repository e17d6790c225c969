"""The local multiple-choice task (``items.jsonl``) scored without lm-eval, both ways it is checked:
lm-evaluation-harness's own request (``local-completions``: ``echo``, ``logprobs`` 1, ``max_tokens`` 1,
token-id prompts, several per request) sent to a Tandem server, and the same log-likelihoods from
``transformers`` directly. ``run.py`` compares lm-eval's numbers with ``reference_loglikelihoods``;
``tests/service/test_prompt_logprobs_api.py`` compares ``tandem_loglikelihoods`` with it.

Tokenization is lm-eval's (``TemplateAPI`` with the remote tokenizer backend, which Tandem serves
through ``/tokenizer_info`` and ``/tokenize``): no BOS, the context's trailing spaces moved to the
continuation, and the continuation = tokens of context + continuation after those of the context.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ITEMS = HERE / "items.jsonl"

Encoded = tuple[list[int], list[int]]  # (context ids, continuation ids)


def load_items(path: Path = ITEMS) -> list[dict[str, Any]]:
    """The task's items: ``{"id", "question", "choices", "answer"}`` (answer = index into choices)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def requests_of(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(context, continuation) per item and choice, in order: lm-eval's ``doc_to_text`` and
    ``target_delimiter + choice``."""
    return [(item["question"], " " + choice) for item in items for choice in item["choices"]]


def encode_pair(tokenizer: Any, context: str, continuation: str) -> Encoded:
    """lm-eval's ``_encode_pair`` for a causal model, without special tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids):]


def tandem_loglikelihoods(url: str, model: str, encoded: list[Encoded],
                          headers: dict[str, str] | None = None) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, is greedy) per request, from one ``/v1/completions`` call with
    lm-eval's body, parsed as its ``parse_logprobs`` does (positions ``ctxlen:-1``).

    Raises:
        httpx.HTTPStatusError: the server did not answer 200.
    """
    import httpx

    body = {"model": model, "prompt": [c + k for c, k in encoded], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
    r.raise_for_status()
    out = []
    for choice, (context, _) in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), encoded, strict=True):
        logprobs = choice["logprobs"]["token_logprobs"][len(context):-1]
        tops = choice["logprobs"]["top_logprobs"][len(context):-1]
        out.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))))
    return out


def reference_loglikelihoods(model_dir: str | Path, encoded: list[Encoded]) -> list[tuple[float, bool]]:
    """The same (log-likelihood, is greedy) from ``transformers`` in float32: the sum over the
    continuation of log-softmax(logits at the previous position)[token]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(len(c) + len(k) for c, k in encoded)
    ids = torch.zeros(len(encoded), width, dtype=torch.long)  # NOTE: right padding, masked: causal rows
    mask = torch.zeros_like(ids)  # are unchanged by what follows them
    for i, (context, continuation) in enumerate(encoded):
        ids[i, :len(context) + len(continuation)] = torch.tensor(context + continuation)
        mask[i, :len(context) + len(continuation)] = 1
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
    out = []
    for i, (context, continuation) in enumerate(encoded):
        rows = logprobs[i, len(context) - 1:len(context) + len(continuation) - 1]
        target = torch.tensor(continuation)
        out.append((float(rows[torch.arange(len(continuation)), target].sum()),
                    bool((rows.argmax(dim=-1) == target).all())))
    return out


def accuracies(items: list[dict[str, Any]], loglikelihoods: list[float]) -> dict[str, float]:
    """lm-eval's ``acc`` (argmax of the log-likelihoods) and ``acc_norm`` (of log-likelihood per
    character of the choice) over ``items``."""
    acc = acc_norm = 0
    i = 0
    for item in items:
        lls = loglikelihoods[i:i + len(item["choices"])]
        lengths = [len(c) for c in item["choices"]]  # NOTE: lm-eval divides by the choice text, no delimiter
        i += len(item["choices"])
        acc += max(range(len(lls)), key=lambda j: lls[j]) == item["answer"]
        acc_norm += max(range(len(lls)), key=lambda j: lls[j] / lengths[j]) == item["answer"]
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items)}
