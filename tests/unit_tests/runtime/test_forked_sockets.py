"""A process forked from a rank (a DataLoader worker) keeps a TCP connection of the rank open until
it closes its copy: ``close_inherited_network_sockets`` closes the copies, so the rank's own close
reaches the peer at once; Unix-domain sockets stay usable in the child. Real sockets, a real fork."""

import multiprocessing as mp
import socket
import sys

import pytest

from tierstack.runtime.forked import close_inherited_network_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc/self/fd")


def _child(release: bool, unix: socket.socket, done) -> None:
    closed = close_inherited_network_sockets(0) if release else 0
    unix.sendall(str(closed).encode())  # the Unix-domain socket it inherited still works
    done.wait(20)  # alive, holding whatever it kept, while the parent closes its end


def _peer_sees_close(release: bool) -> tuple[bool, int]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    parent_end, child_end = socket.socketpair()
    ctx = mp.get_context("fork")
    done = ctx.Event()
    child = ctx.Process(target=_child, args=(release, child_end, done))
    child.start()
    try:
        parent_end.settimeout(20)
        closed = int(parent_end.recv(16))
        client.close()  # the rank releases its connection
        peer.settimeout(1.0)
        try:
            seen = peer.recv(1) == b""  # EOF: the connection closed
        except socket.timeout:
            seen = False  # still open: the child holds a copy
        return seen, closed
    finally:
        done.set()
        child.join(20)
        for s in (server, peer, parent_end, child_end):
            s.close()


def test_the_peer_sees_the_close_only_when_the_child_released_its_copies():
    seen, closed = _peer_sees_close(release=True)
    assert seen and closed >= 2  # (the listening socket and the client's connection, at least)
    seen, closed = _peer_sees_close(release=False)
    assert not seen and closed == 0  # the mechanism: a forked copy keeps the connection open
