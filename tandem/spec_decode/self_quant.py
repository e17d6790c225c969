"""Self-speculation with a quantized copy of the target: int8 or int4 weight-only linear layers.

The draft is the target's own module tree with every ``Linear`` replaced by a ``QuantizedLinear``
(``tandem/models/quant.py``: int8 per output channel, int4 per group of 32 in llama.cpp's Q4_0
layout, the LM head always int8), while the embedding, norms and RoPE tables are shared with the
target, not copied. So no second checkpoint is needed, the draft agrees with the target most of the
time, and a decode step reads a half (int8, from bfloat16) to about a quarter (int4) of the bytes.
"""

from __future__ import annotations

import copy
import itertools

from tandem.models.llama import LlamaForCausalLM
from tandem.models.quant import quantize_model


def quantized_copy(target: LlamaForCausalLM, quantization: str) -> LlamaForCausalLM:
    """The target's module tree with every linear layer quantized to ``quantization`` ("int8" / "int4").

    Only the modules are copied: every parameter and buffer of ``target`` is shared, and the copy's
    linear layers get new quantized buffers. ``target`` is not changed.

    Raises:
        ValueError: an unknown ``quantization``.
    """
    # NOTE: deepcopy with every tensor pre-seeded in the memo copies the modules and shares the tensors.
    memo = {id(t): t for t in itertools.chain(target.parameters(), target.buffers())}
    draft = copy.deepcopy(target, memo)
    return quantize_model(draft, quantization).eval()
