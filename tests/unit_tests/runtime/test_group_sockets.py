"""An abort's release of the process groups frees a peer blocked in a gloo collective at once, even
while the aborting rank still refers to the groups (as an interrupted attempt's model and frames
do): two real ranks, megatron-core's real tensor-parallel group, real gloo connections. Without the
connections' shutdown the blocked peer came back only when the other process exited (measured
9.0 s here, the length of its sleep), and under in-process restart NVRx's hard timeout killed it."""

import os
import socket
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")

HOLD_S = 20.0  # how long the releasing rank keeps its process (and its references) after the release


def _rank(rank: int, port: int, out) -> None:
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        from tierstack import runtime

        runtime.initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, seed=1)
        tp = parallel_state.get_tensor_model_parallel_group()  # kept, as a megatron module keeps it
        dist.all_reduce(torch.ones(4), group=tp)
        if rank == 1:
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4), group=tp)  # rank 0 never joins: it releases its groups
                out.put(("returned", time.monotonic() - t0, ""))
            except RuntimeError as e:
                out.put(("raised", time.monotonic() - t0, str(e)[:200]))
        else:
            time.sleep(1.0)  # rank 1 is inside its all_reduce by now
            runtime.release_distributed()
            out.put(("released", 0.0, repr(tp)))
            time.sleep(HOLD_S)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put(("error", 0.0, repr(e)))


def test_a_peer_blocked_in_a_collective_fails_at_once_when_a_rank_releases_groups_it_still_refers_to(start_ranks,
                                                                                                     free_port):
    procs, out = start_ranks(_rank, free_port)  # fresh interpreters: no group of the test process
    try:
        got = {}
        while len(got) < 2:
            kind, seconds, text = out.get(timeout=120)
            assert kind != "error", text
            got[kind] = (seconds, text)
        assert "raised" in got, got  # the collective failed instead of completing or hanging
        seconds, text = got["raised"]
        assert seconds < 5.0, got  # freed by the release (1 s after it began), not by rank 0's exit (21 s)
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def test_listening_sockets_and_connections_made_before_any_group_are_never_shut_down():
    """What :func:`group_sockets.shut_down` may touch: only sockets that appeared while a group was
    built, still the same socket (inode), and connected."""
    from tierstack.runtime import group_sockets

    server = socket.create_server(("127.0.0.1", 0))
    before = socket.create_connection(server.getsockname())  # made before: a store's connection
    accepted_before, _ = server.accept()
    group_sockets.uninstall()
    try:
        group_sockets.install()
        from torch.distributed import distributed_c10d as c10d

        made = []

        def fake_group_build():  # what gloo does while a group is built: a connection and a listener
            made.append(socket.create_connection(server.getsockname()))
            made.append(socket.create_server(("127.0.0.1", 0)))

        real = group_sockets._original
        group_sockets._original = lambda *a, **k: fake_group_build()
        try:
            c10d._new_process_group_helper()
        finally:
            group_sockets._original = real
        conn, listener = made
        peer, _ = server.accept()
        assert group_sockets.shut_down() == 1  # the connection only
        assert peer.recv(1) == b""  # its peer sees it closed
        before.sendall(b"x")
        assert accepted_before.recv(1) == b"x"  # the earlier connection still works
        listener.settimeout(0.01)
        with pytest.raises(socket.timeout):
            listener.accept()  # still listening (no error)
        assert group_sockets.shut_down() == 0  # forgotten once shut down
        for s in (conn, listener, peer):
            s.close()
    finally:
        group_sockets.uninstall()
        for s in (server, before, accepted_before):
            s.close()
