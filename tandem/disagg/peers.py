"""Which prefill engines a decode engine may pull KV from (``KVTransferConfig.prefill_hosts``).

A decode leg names its producer in ``kv_transfer_params.remote_host`` / ``remote_port``, and those come
from whoever sent the request. Without a check a client could make the decode engine open connections
to any address it likes (a server-side request forgery). So the decode side connects only to hosts on
its allowlist: loopback by default (``localhost``, 127.0.0.0/8, ::1, plus this engine's own
``kv_ip``), or exactly the entries of ``prefill_hosts``. An entry is an IP address, a CIDR network
(``10.0.0.0/24``), or a host name compared as written (names are never resolved here: a DNS answer
can change between the check and the connection), each optionally with ``:port`` (``[::1]:14579``
for IPv6) to allow that port only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

LOOPBACK = ("localhost", "127.0.0.0/8", "::1")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PeerRule:
    """One allowlist entry: a network (IP or CIDR) or a lower-case host name, and a port (None: any)."""

    network: Network | None
    name: str | None
    port: int | None

    @classmethod
    def parse(cls, entry: str) -> PeerRule:
        """Raises: ValueError: an empty entry, a bad port, or a malformed address or network."""
        text = entry.strip()
        if not text:
            raise ValueError("a prefill_hosts entry must not be empty")
        host, port = text, None
        if text.startswith("["):  # [v6] or [v6]:port
            host, bracket, rest = text[1:].partition("]")
            if not bracket or rest and not rest.startswith(":"):
                raise ValueError(f"prefill_hosts entry {entry!r} is not an IP address: expected [address]:port")
            port = _port(rest[1:], entry) if rest else None
        elif text.count(":") == 1:  # host:port (an IPv6 literal without brackets has several colons)
            host, port_text = text.split(":")
            port = _port(port_text, entry)
        try:
            return cls(ipaddress.ip_network(host, strict=False), None, port)
        except ValueError:
            pass
        if not host or any(c in host for c in "/[]@ ") or host.replace(".", "").isdigit():
            raise ValueError(f"prefill_hosts entry {entry!r} is not an IP address, a CIDR network or a host name")
        return cls(None, host.lower().rstrip("."), port)

    def allows(self, host: str, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.name is not None:
            return host.lower().rstrip(".") == self.name
        try:
            return ipaddress.ip_address(host) in self.network
        except ValueError:
            return False


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"prefill_hosts entry {entry!r}: the port must be 1-65535")
    return int(text)


class PeerAllowlist:
    """The prefill peers a decode engine may connect to.

    Args:
        entries: ``prefill_hosts`` (None: loopback only).
        own_host: this engine's ``kv_ip`` when it is a producer too (``kv_both``), allowed by default.

    Raises: ValueError: a malformed entry (see ``PeerRule.parse``).
    """

    def __init__(self, entries: tuple[str, ...] | None, own_host: str | None = None) -> None:
        default = entries is None
        self.entries = LOOPBACK + ((own_host,) if own_host else ()) if default else tuple(entries)
        self.rules = [PeerRule.parse(e) for e in self.entries]
        self.default = default

    def allows(self, host: str, port: int) -> bool:
        """True when ``host:port`` matches an entry. Changes nothing."""
        return any(rule.allows(host.strip("[]"), port) for rule in self.rules)

    def refusal(self, host: str, port: int) -> str | None:
        """Why ``host:port`` may not be used (a client-facing sentence), or None when it may."""
        if self.allows(host, port):
            return None
        where = "loopback (the default)" if self.default else ", ".join(self.entries)
        return (f"kv_transfer_params.remote_host {host!r} (port {port}) is not an allowed prefill engine; this "
                f"decode engine pulls KV only from {where}: add it to \"prefill_hosts\" in --kv-transfer-config")
