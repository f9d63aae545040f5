"""The network links of this process's network namespace that a UCX worker can use, as a comparable snapshot."""

from __future__ import annotations

import fcntl
import socket
import struct

# <linux/if.h>, <linux/sockios.h>
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40
SIOCGIFFLAGS, SIOCGIFADDR = 0x8913, 0x8915
_IFREQ = 40  # struct ifreq: a 16-byte name, then a 24-byte union (flags: a short; addr: a sockaddr)


def links_up() -> frozenset[tuple[str, str]]:
    """(interface, IPv4 address) of every non-loopback interface that is up and has a carrier, in this namespace.

    UCX's TCP transport lists these once, when a worker is made, and never looks again: a worker made while this
    node's link was down (no carrier) holds loopback only and reaches no other node for the rest of its life, even
    after the link returns. An agent compares this snapshot with the one taken at its making to know it is stale.
    An interface without an IPv4 address has address ""."""
    up = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack(f"{_IFREQ}s", name.encode()[:15])
            try:
                (flags,) = struct.unpack_from("H", fcntl.ioctl(probe.fileno(), SIOCGIFFLAGS, request), 16)
            except OSError:
                continue  # gone since it was listed
            if not flags & IFF_UP or not flags & IFF_RUNNING or flags & IFF_LOOPBACK:
                continue
            try:
                address = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24])
            except OSError:
                address = ""  # no IPv4 address (EADDRNOTAVAIL)
            up.add((name, address))
    return frozenset(up)
