"""Fixtures shared by the unit tests."""

import multiprocessing as mp
import socket

import pytest


@pytest.fixture
def start_ranks():
    """A function that starts real processes for a multi-rank unit test: ``start(target, *args,
    world_size=2)`` spawns ``target(rank, *args, out)`` for ranks ``0..world_size-1`` (the spawn start
    method: a fresh interpreter each, as torchrun's ranks) and returns ``(processes, out)``, ``out``
    being the queue they report into. Joining, killing and reading ``out`` are the test's."""

    def start(target, *args, world_size: int = 2):
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=target, args=(rank, *args, out)) for rank in range(world_size)]
        for p in procs:
            p.start()
        return procs, out

    return start


@pytest.fixture
def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for a store server a spawned rank hosts;
    another process could still take it before that rank binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
