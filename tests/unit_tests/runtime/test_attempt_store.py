"""The ranks of one start agree on a token of their own in a store that earlier starts left keys in
(:mod:`tierstack.runtime.attempt_store`): real TCPStore server and clients, one thread per rank."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierstack.runtime import attempt_store
from tierstack.runtime.attempt_store import StartHandshakeError, agree_on_start


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def _start(server, world_size: int, ranks=None, timeout_s: float = 20.0) -> dict:
    """Run :func:`agree_on_start` for ``ranks`` (default all), one thread and client each: rank -> token or error."""
    out: dict = {}

    def rank_main(rank):
        try:
            out[rank] = agree_on_start(_client(server), rank, world_size, timeout_s)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (range(world_size) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_every_start_agrees_on_a_new_token_whatever_a_dead_start_left(server):
    first = _start(server, 4)
    assert len(set(first.values())) == 1 and all(isinstance(t, str) for t in first.values()), first
    # A start that died half way: rank 0 drew a token and answered ranks 1 and 2, rank 3 never came
    # (its hello of the first start is still there, and so are the answers rank 0 never removed).
    dead = _start(server, 4, ranks=[0, 1, 2], timeout_s=1.0)
    assert isinstance(dead[0], StartHandshakeError) and dead[1] == dead[2], dead
    second = _start(server, 4)
    assert len(set(second.values())) == 1 and all(isinstance(t, str) for t in second.values()), second
    assert set(second.values()) != set(first.values())
    third = _start(server, 4)
    assert len(set(third.values())) == 1 and not set(third.values()) & (set(first.values()) | set(second.values()))


def test_rank_0_names_the_ranks_that_never_joined(server):
    out = _start(server, 3, ranks=[0, 1], timeout_s=1.0)
    assert isinstance(out[0], StartHandshakeError) and "rank(s) [2] of this start did not" in str(out[0])
    assert "distributed.timeout_s" in str(out[0])


def test_a_rank_without_rank_0_says_so_within_the_timeout(server):
    out = _start(server, 2, ranks=[1], timeout_s=0.5)
    assert isinstance(out[1], StartHandshakeError) and "rank 1: rank 0 of this start did not answer" in str(out[1])


def test_only_the_agents_store_gets_a_store_of_its_own(monkeypatch):
    monkeypatch.delenv(attempt_store.AGENT_STORE_ENV, raising=False)
    assert attempt_store.attempt_store(0, 2, 1.0) is None  # torch's env:// is right then
    monkeypatch.setenv(attempt_store.AGENT_STORE_ENV, "False")  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    assert attempt_store.attempt_store(0, 2, 1.0) is None
    monkeypatch.setenv(attempt_store.AGENT_STORE_ENV, "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "not-a-port")
    with pytest.raises(ValueError, match="MASTER_PORT='not-a-port'"):
        attempt_store.attempt_store(0, 2, 1.0)
