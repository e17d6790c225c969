"""What every config group shares: ``ConfigError``, the integer check, TCP addresses and loopback hosts."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigError(ValueError):
    """An invalid configuration value (a user error at start-up)."""


def parse_tcp_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 hosts in brackets) -> (host, port).

    Raises:
        ConfigError: another scheme, no host, or a port outside 1-65535.
    """
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ConfigError(f"an engine address must look like tcp://HOST:PORT, got {address!r}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"an engine address must look like tcp://HOST:PORT with a port 1-65535, got {address!r}")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); False for names, ``*``,
    ``0.0.0.0`` and every other address."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
