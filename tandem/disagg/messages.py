"""The KV transfer wire protocol between a decode engine (DEALER) and a prefill engine (ROUTER).

Handshake: the decode side sends ``KVHello`` with its ``KVIdentity``; the producer answers
``KVRefused`` when the identity differs (naming the fields) or ``KVChallenge`` with a fresh nonce;
the decode side answers ``KVProof`` (HMAC-SHA256 of the nonce under the shared secret,
``engine/handshake.sign``) and gets ``KVAdmitted`` (with the port and one-time token of its data
connection) or ``KVRefused``. Only an admitted peer may ``PullKV``, ``RenewLeases`` and ``ReleaseLeases``.

A pull is answered on the peer's data connection (``data_channel.py``: a header, every layer's K and V
bytes straight from and into the caches, a trailer; or an error reason), not here. msgpack via msgspec,
never pickle.
"""

from __future__ import annotations

import msgspec

KV_PROTOCOL_VERSION = 2  # 2: block bytes on a data connection (data_channel.py)


class KVIdentity(msgspec.Struct, frozen=True):
    """What must match for one engine's KV blocks to mean the same in another's cache.

    ``model_hash``: SHA-256 over the model config and the weights' names and shapes (target and
    draft). ``caches``: per cache (target, then draft) ``(num_layers, num_kv_heads, head_size)``.
    """

    model_hash: str
    dtype: str
    block_size: int
    caches: list[tuple[int, int, int]]

    def mismatches(self, other: KVIdentity) -> list[str]:
        """Human-readable differences, this side's value first (empty when compatible)."""
        out = []
        if self.model_hash != other.model_hash:
            out.append(f"model (hash of config + weight names and shapes) {self.model_hash[:12]} != "
                       f"{other.model_hash[:12]}")
        if self.dtype != other.dtype:
            out.append(f"dtype {self.dtype} != {other.dtype}")
        if self.block_size != other.block_size:
            out.append(f"block size {self.block_size} != {other.block_size}")
        names = ("target", "draft")
        if len(self.caches) != len(other.caches):
            out.append(f"{len(self.caches)} KV caches (target + draft) != {len(other.caches)}")
        for i, (mine, theirs) in enumerate(zip(self.caches, other.caches, strict=False)):
            for what, a, b in zip(("layers", "KV heads", "head size"), mine, theirs, strict=True):
                if a != b:
                    out.append(f"{names[min(i, 1)]} {what} {a} != {b}")
        return out


class KVHello(msgspec.Struct, tag="kv_hello"):
    identity: KVIdentity
    protocol: int = KV_PROTOCOL_VERSION


class KVChallenge(msgspec.Struct, tag="kv_challenge"):
    nonce: bytes
    auth: bool


class KVProof(msgspec.Struct, tag="kv_proof"):
    mac: bytes


class KVAdmitted(msgspec.Struct, tag="kv_admitted"):
    """Admitted: open a TCP connection to ``data_port`` (on the same host) and send ``data_token`` first."""

    engine_id: str
    data_port: int
    data_token: bytes


class KVRefused(msgspec.Struct, tag="kv_refused"):
    reason: str


class PullKV(msgspec.Struct, tag="pull"):
    """Send the KV of ``block_ids`` (a subset of the lease's blocks, each at the generation the prefill
    leg reported) and renew the lease. ``xfer_id`` tags the reply on the data connection."""

    xfer_id: int
    lease_id: str
    block_ids: list[int]
    generations: list[int]


class RenewLeases(msgspec.Struct, tag="renew"):
    lease_ids: list[str]


class ReleaseLeases(msgspec.Struct, tag="release"):
    lease_ids: list[str]


ToProducer = KVHello | KVProof | PullKV | RenewLeases | ReleaseLeases
ToConsumer = KVChallenge | KVAdmitted | KVRefused
