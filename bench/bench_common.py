"""What the Python benchmark scripts of bench/ share (they import it from their own folder)."""

import socket


def free_ports(n):
    """n ports of 127.0.0.1 nothing listens on now (bound once and released)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
