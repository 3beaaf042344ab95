"""Which address of rank 0's host the other ranks connect to: the rendezvous store's address.

A node often has several interfaces (Ethernet, InfiniBand's IPoIB, a
container bridge, a management network), and the first address of
``hostname -I`` or the address the hostname resolves to is not always one
the other nodes reach. The choice here, made on rank 0 from what every other
node reports about itself:

1. an interface of rank 0's host whose subnet holds an address of another
   node (the two are on one link: the route between them goes through it);
   where several subnets hold it, the narrowest, as the kernel's longest-prefix
   route does (a wider subnet on another interface, such as a /15 on a bridge
   beside the link's /24, is not the link);
2. otherwise the source address of the kernel's route toward another node
   (its addresses, then its hostname resolved);
3. otherwise the address rank 0's hostname resolves to, if not a loopback.

``MPIDP_RDZV_ADDR`` (an address) and ``MPIDP_RDZV_IFACE`` (an interface of
rank 0's host) override it (``mpidp.rendezvous`` reads them). Only IPv4 is
chosen automatically; an IPv6 address may be given through ``MPIDP_RDZV_ADDR``.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

__all__ = ["interfaces", "interface_address", "route_source", "choose"]

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 address, mask


def _ioctl_address(sock: socket.socket, request: int, name: str) -> str:
    import fcntl  # POSIX only: imported where it is used
    packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, tuple[str, str]]:
    """This host's interfaces with an IPv4 address: name -> (address, netmask); {} if unreadable."""
    found = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                found[name] = (_ioctl_address(sock, _SIOCGIFADDR, name),
                               _ioctl_address(sock, _SIOCGIFNETMASK, name))
            except (OSError, ImportError):  # no IPv4 address on it, or not Linux
                continue
    return found


def interface_address(name: str) -> str:
    """The IPv4 address of this host's interface ``name``.

    Raises:
        ValueError: naming the interface and those this host has.
    """
    found = interfaces()
    if name not in found:
        listed = ", ".join(f"{n} ({a})" for n, (a, _) in sorted(found.items())) or "none found"
        raise ValueError(f"MPIDP_RDZV_IFACE={name!r}: rank 0's host {socket.gethostname()} has no "
                         f"IPv4 interface of that name; its interfaces: {listed}")
    return found[name][0]


def given_address(value: str) -> str:
    """``MPIDP_RDZV_ADDR``'s value, if rank 0's host can listen on it.

    Raises:
        ValueError: naming the variable, the rule and the value (a name that
            does not resolve, or an IPv4 address of no interface of this host).
    """
    try:
        resolved = sorted({info[4][0] for info in socket.getaddrinfo(value, None)})
    except OSError as error:
        raise ValueError(f"MPIDP_RDZV_ADDR={value!r} does not resolve to an address ({error})") \
            from None
    own = interfaces()
    if not own or any(address in {a for a, _ in own.values()} or ":" in address
                      or ipaddress.ip_address(address).is_loopback for address in resolved):
        return value  # (IPv6 addresses are not listed by interfaces(): left to the server)
    listed = ", ".join(f"{n} ({a})" for n, (a, _) in sorted(own.items()))
    raise ValueError(f"MPIDP_RDZV_ADDR={value!r} ({', '.join(resolved)}) is no address of rank "
                     f"0's host {socket.gethostname()}, so its store cannot listen there; its "
                     f"interfaces: {listed}")


def route_source(destination: str) -> str | None:
    """The address this host sends from toward ``destination`` (asks the kernel; no packet leaves)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((destination, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def _is_loopback(address: str | None) -> bool:
    return address is None or ipaddress.ip_address(address).is_loopback


def _resolve(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)})
    except OSError:
        return []


def choose(own: dict[str, tuple[str, str]], peers: list[tuple[str, list[str]]]) -> tuple[str, str]:
    """Rank 0's address for the others to connect to, and why it was chosen (see the module).

    Args:
        own: rank 0's ``interfaces()``.
        peers: for each other node, (its hostname, its IPv4 addresses), in rank order.

    Returns:
        (address, reason), the reason a short phrase for messages.
    """
    networks = {name: ipaddress.ip_network(f"{address}/{mask}", strict=False)
                for name, (address, mask) in own.items() if not _is_loopback(address)}
    for host, addresses in peers:
        for peer in addresses:
            holding = [name for name, network in networks.items()
                       if ipaddress.ip_address(peer) in network]
            if holding:
                name = max(holding, key=lambda held: networks[held].prefixlen)
                return own[name][0], f"interface {name}, on the link to {host} ({peer})"
    for host, addresses in peers:
        for peer in [*addresses, *_resolve(host)]:
            source = route_source(peer)
            if not _is_loopback(source):
                return source, f"the route toward {host} ({peer})"
    for address in _resolve(socket.gethostname()):
        if not _is_loopback(address):
            return address, f"rank 0's hostname {socket.gethostname()}"
    raise ValueError(f"no address of rank 0's host {socket.gethostname()} reaches the other "
                     f"nodes ({', '.join(host for host, _ in peers)}): set MPIDP_RDZV_ADDR or "
                     f"MPIDP_RDZV_IFACE")
