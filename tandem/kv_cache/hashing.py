"""Chained hashes of full KV blocks: the keys of the automatic prefix cache (as in vLLM v1).

Block ``i`` of a sequence (tokens ``[i * block_size, (i + 1) * block_size)``) has the hash
``H(hash of block i-1, token ids of block i)``, with a fixed ``ROOT_HASH`` as the parent of block 0.
Because the parent is chained in, equal hashes mean equal *prefixes*, so the KV of the block (which
depends on every earlier token) can be shared. Only full blocks are hashed; a partial last block
is never shared.

``H`` is SHA-256 over ``parent (32 bytes, big-endian) || token ids (int64, little-endian)``, kept as
a 256-bit Python int (``Request.block_hashes: list[int]``).
NOTE: SHA-256 rather than Python's ``hash()`` of tuples: a 64-bit non-cryptographic hash can be made
to collide on purpose (one user reading another's KV), and SHA-256 with a fixed root and an explicit
byte encoding is identical in every process and machine, so a router can compute the same keys
for prefix-affinity routing. It costs about a microsecond per block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from tandem.request import Request

ROOT_HASH: int = int.from_bytes(hashlib.sha256(b"tandem/kv-block-root/v1").digest(), "big")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (None for the first block of a sequence)."""
    parent = ROOT_HASH if parent_hash is None else parent_hash
    h = hashlib.sha256(parent.to_bytes(32, "big"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "big")


def salted_root(salt: str) -> int:
    """A parent hash for block 0 other than ``ROOT_HASH``: requests whose KV differs for the same tokens
    (e.g. longrope's long factors, ``ModelRunner.block_hash_root``) never share blocks with the rest."""
    return int.from_bytes(hashlib.sha256(ROOT_HASH.to_bytes(32, "big") + salt.encode()).digest(), "big")


def hash_token_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (``len(token_ids) // block_size`` of them)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extends ``request.block_hashes`` with the hashes of blocks that became full since the last call.

    Covers prompt and output tokens (so a preempted request finds its own generated blocks again); block 0's
    parent is ``request.block_hash_root`` (None: ``ROOT_HASH``).
    Changes: ``request.block_hashes`` (append only).
    """
    num_full = request.num_tokens // block_size
    hashes = request.block_hashes
    while len(hashes) < num_full:
        i = len(hashes)
        parent = hashes[-1] if hashes else request.block_hash_root
        tokens = request.token_ids_slice(i * block_size, (i + 1) * block_size)
        hashes.append(hash_block_tokens(parent, tokens))
