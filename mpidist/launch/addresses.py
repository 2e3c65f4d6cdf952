"""Which of this host's addresses other hosts can reach.

A meeting point (the default store, the PMI server of a world without a
launcher, ``MASTER_ADDR``) must be advertised on an address the other hosts
reach. The host name is not enough: Debian and Ubuntu map it to ``127.0.1.1`` in
``/etc/hosts``, so ``gethostbyname(gethostname())`` is a loopback address there.
This module answers from the kernel instead: the source address it would use to
reach a peer (a UDP ``connect``, which sends nothing), or failing that the
addresses of this host's interfaces. IPv4 only, as MPI's and torch's stores.

Example::

    >>> is_loopback("127.0.1.1"), is_loopback("10.0.0.5")
    (True, False)
    >>> reachable_address(["10.0.0.7"])   # the address of the interface towards 10.0.0.7
    '10.0.0.5'
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Iterable

__all__ = ["is_loopback", "resolve", "own_addresses", "source_address_towards", "reachable_address", "meeting_address"]

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 (and ::1); False for names and other addresses."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str | None:
    """The IPv4 address ``host`` resolves to here (itself if it is one), or None."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return None


def own_addresses() -> list[str]:
    """This host's IPv4 addresses that are not loopback: its interfaces', then its name's."""
    found: list[str] = []
    try:
        import fcntl

        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                try:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:  # no IPv4 address on this interface
                    continue
                found.append(socket.inet_ntoa(packed[20:24]))
    except (ImportError, OSError, AttributeError):  # not Linux
        pass
    try:
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    unique = dict.fromkeys(a for a in found if not is_loopback(a) and a != "0.0.0.0")
    return list(unique)


def source_address_towards(peer: str) -> str | None:
    """The address the kernel would send from to reach ``peer`` (nothing is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def reachable_address(peers: Iterable[str]) -> str | None:
    """An address of this host that the hosts at ``peers`` can reach (never loopback), or None.

    The first peer the kernel has a route to decides; without one, this host's
    first interface address.
    """
    for peer in peers:
        if is_loopback(peer):
            continue
        source = source_address_towards(peer)
        if source and not is_loopback(source) and source != "0.0.0.0":
            return source
    mine = own_addresses()
    return mine[0] if mine else None


def meeting_address(master_addr: str | None, peers: Iterable[str]) -> str | None:
    """The address rank 0 advertises to ranks on other hosts (``peers``: their addresses).

    ``MASTER_ADDR`` when it names an address of a host that is not loopback here
    (a name resolves first), else an address of this host that the peers reach;
    None when there is none (the caller says so: never a loopback address across hosts).
    """
    if master_addr:
        resolved = resolve(master_addr)
        if resolved and not is_loopback(resolved):
            return resolved
    return reachable_address(peers)
