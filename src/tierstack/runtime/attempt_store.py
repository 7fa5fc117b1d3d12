"""The ranks' store under torchrun's shared rendezvous store: keys of this start only.

Why. torchrun's c10d rendezvous (``--standalone``, ``--rdzv-backend c10d``; torch >= 2.5) hosts the
store of the ranks' process groups in its agent and keeps that one store server for every restart
of ``--max-restarts``: ``DynamicRendezvousHandler.next_rendezvous`` makes the server once
(``_shared_tcp_store_server``) and hands every later round the cached ``_bootstrap_store_info``, the
same ``MASTER_ADDR:MASTER_PORT`` (torch 2.13, ``torch/distributed/elastic/rendezvous/
dynamic_rendezvous.py``, ``next_rendezvous``). The ranks' ``init_process_group("env://")`` connects
to it without any prefix of the start (``torch/distributed/rendezvous.py``, ``_create_c10d_store``:
"We create a new TCPStore for every retry so no need to add prefix for each attempt"), and the
process groups' keys are the same names in every start (``default_pg/0/...``, gloo's full-mesh
addresses of each rank). So after a restart a rank reads its peer's address from the start that
died and gloo fails in ``connectFullMesh`` ("Connection refused"), or the connections it made
are reset as the peer starts over ("Connection reset by peer"), start after start
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it: rank 0 then hosts a new store each start).

Why not ``TORCHELASTIC_RESTART_COUNT`` as the prefix: each agent counts only the failures of its
own ranks, and an agent whose ranks were healthy restarts them without counting
(``torch/distributed/elastic/agent/server/api.py``, ``_invoke_run``: "membership changes do not
count as retries"), so on several nodes the ranks of one start see different counts and would wait
for each other under different prefixes (pytorch issue #135712, where torch's own per-attempt
prefix failed that way).

How. Global rank 0 draws a new token each start and gives it to every other rank through the
shared store, each rank under a key that only that rank knows (a nonce it drew itself), so no rank
can take a token left by a start that died; then every process group of the start lives under
``tierstack/start/<token>/``. The agents stop every rank of a start before the next one begins, so
every process that takes part is of this start.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # "True" when the agent hosts the ranks' store
_ROOT = "tierstack/start"
_POLL_S = 0.01  # rank 0's poll of the others' hellos while it waits for them (one multi_get each)


_given: Optional[dist.Store] = None  # an in-process restart's store of its attempt (see use_attempt_store)


def use_attempt_store(store: Optional[dist.Store]) -> None:
    """Make :func:`attempt_store` return ``store`` (None: back to torchrun's environment).

    The in-process restart (:mod:`tierstack.resiliency.in_process`) gives each of its attempts a
    store of its own, under a prefix no earlier attempt used: the process groups of an attempt
    never read the keys of one that was aborted (gloo's full-mesh addresses of ranks that died).
    """
    global _given
    _given = store


def meet(store: dist.Store, world_size: int, timeout_s: float) -> None:
    """Wait, in Python, until ``world_size`` ranks called this on ``store`` (a fresh prefix).

    Why: under in-process restart a rank that fails before its process groups exist (during its
    set-up) leaves the others inside gloo's rendezvous of ``init_process_group``, blocked in C
    where NVRx's interruption cannot reach them: each was then killed by NVRx's hard timeout and
    replaced, losing its process. Polling here (one store call every 10 ms) keeps the main thread
    in Python until every rank is there, so the interruption ends the wait; once all have met,
    the groups are built with every rank present.

    Raises:
        StartHandshakeError: fewer than ``world_size`` ranks came within ``timeout_s`` seconds.
    """
    store.add("meet", 1)
    deadline = time.monotonic() + timeout_s
    while (n := store.add("meet", 0)) < world_size:
        if time.monotonic() > deadline:
            raise StartHandshakeError(f"{n} of {world_size} ranks met before their process groups within "
                                      f"{timeout_s:g} s (distributed.timeout_s)")
        time.sleep(_POLL_S)


class DelegatingStore(dist.Store):
    """A Python store that does each operation on ``inner``: the base of a store that changes a few
    of them (torch calls a Python store from C++ through its Python store bridge, so a C++ store
    over it, such as a ``PrefixStore``, reaches the changed ones).

    Args:
        inner: the store it reads and writes.
    """

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(list(keys))

    def wait(self, keys, timeout: Optional[timedelta] = None):
        if timeout is None:
            self.inner.wait(list(keys))
        else:
            self.inner.wait(list(keys), timeout)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


class InterruptibleStore(DelegatingStore):
    """A store whose waits for keys run in Python: what an in-process attempt builds its process
    groups on (:func:`use_attempt_store`).

    Why: gloo's rendezvous, while a group is built (``init_process_group``, every ``new_group`` of
    megatron-core's), waits in the store for each peer's address. On a C++ store that wait is in
    C for up to the store's timeout, where NVRx's interruption (an exception raised into the main
    thread) cannot reach it: a rank whose peer died after the ranks met (:func:`meet`) but before
    its groups were built was killed by NVRx's hard timeout and replaced, losing its process (a
    second fault while the first was being recovered, seen by a break-it pass). Here every wait
    is a loop of ``check`` calls with short sleeps (0.5 ms at first, then up to 10 ms), so the
    interruption ends it and propagates out of the group's construction as itself (torch calls
    this class from C++ through its Python store bridge). Measured: a ``new_group`` whose peer never
    came raised the interruption 1.01 s after it began, 1 s after the start of the group's build;
    on the C++ store it was still blocked 40 s later.

    Args:
        inner: the store it reads and writes (a prefix of the job's store).
        timeout_s: seconds a wait may take before :class:`torch.distributed.DistStoreError`
            (``distributed.timeout_s``; a shorter timeout passed to a wait wins).
    """

    def __init__(self, inner: dist.Store, timeout_s: float):
        super().__init__(inner)
        self.timeout_s = float(timeout_s)

    def _wait(self, keys: list, timeout=None) -> None:
        limit = self.timeout_s if timeout is None else min(self.timeout_s, timeout.total_seconds() or self.timeout_s)
        deadline, pause = time.monotonic() + limit, 0.0005
        while not self.inner.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"keys {keys} not set within {limit:g} s (distributed.timeout_s)")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def get(self, key):
        self._wait([key])
        return self.inner.get(key)

    def wait(self, keys, timeout=None):
        self._wait(list(keys), timeout)

    def set_timeout(self, timeout):
        self.timeout_s = timeout.total_seconds()


class StartHandshakeError(RuntimeError):
    """The ranks of this start did not all meet in the store within the timeout."""


def uses_agent_store() -> bool:
    """True when torchrun's agent hosts the ranks' store and keeps it across restarts
    (``TORCHELASTIC_USE_AGENT_STORE=True``, set by torchrun for each rank; False with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, under ``ft_launcher`` or without a launcher)."""
    return os.environ.get(AGENT_STORE_ENV, "").strip().lower() == "true"


def attempt_store(rank: int, world_size: int, timeout_s: float) -> Optional[dist.Store]:
    """The store for ``init_process_group(store=...)``: under torchrun's shared store, a prefix of
    its own for this start (see the module docstring); None otherwise (torch's ``env://`` is right).

    Args:
        rank / world_size: this rank and the world size (torchrun's ``RANK`` / ``WORLD_SIZE``).
            A store given by :func:`use_attempt_store` is returned as it is.
        timeout_s: seconds each store operation, and the whole handshake, may take
            (``distributed.timeout_s``).

    Raises:
        ValueError: ``MASTER_ADDR`` or ``MASTER_PORT`` missing or not a port while
            ``TORCHELASTIC_USE_AGENT_STORE=True``.
        StartHandshakeError: the other ranks (rank 0: which ones) did not join within ``timeout_s``.
    """
    if _given is not None:
        meet(_given, world_size, timeout_s)
        return _given
    if not uses_agent_store():
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{AGENT_STORE_ENV}=True needs MASTER_ADDR and MASTER_PORT (the agent's store), got "
                         f"MASTER_ADDR={addr!r} MASTER_PORT={port!r}")
    store = dist.TCPStore(addr, int(port), world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    token = agree_on_start(store, rank, world_size, timeout_s)
    return dist.PrefixStore(f"{_ROOT}/{token}/", store)


def agree_on_start(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """Collective over ``store``: every rank of this start returns the same new token, which no
    earlier start used, whatever keys earlier starts left in ``store``.

    Rank ``r > 0`` writes a nonce of its own to ``hello/<r>`` and waits for ``reply/<nonce>``;
    rank 0 answers every nonce it finds under ``hello/*`` (a dead start's too: that answer is never
    read) until every rank has confirmed under the new token (``joined/<token>``), then removes
    its answers.

    Args:
        store: the shared store (no prefix of the start).
        rank / world_size: this rank, the number of ranks.
        timeout_s: seconds to wait for the other ranks.

    Raises:
        StartHandshakeError: rank 0: not every rank joined within ``timeout_s`` (names them);
            another rank: no answer from rank 0 within ``timeout_s``.
    """
    if world_size == 1:
        return uuid.uuid4().hex
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_ROOT}/hello/{rank}", nonce)
        try:
            store.wait([f"{_ROOT}/reply/{nonce}"], timedelta(seconds=timeout_s))
        except dist.DistStoreError as e:
            raise StartHandshakeError(
                f"rank {rank}: rank 0 of this start did not answer in the rendezvous store within {timeout_s:g} s "
                f"(distributed.timeout_s): {e}") from e
        token = store.get(f"{_ROOT}/reply/{nonce}").decode()
        store.set(f"{_ROOT}/{token}/joined/{rank}", "1")
        store.add(f"{_ROOT}/{token}/joined", 1)
        return token
    return _serve_start(store, world_size, timeout_s)


def _serve_start(store: dist.Store, world_size: int, timeout_s: float) -> str:
    """Rank 0's side of :func:`agree_on_start`: answer hellos until all ``world_size - 1`` joined."""
    token = uuid.uuid4().hex
    others = range(1, world_size)
    hellos = [f"{_ROOT}/hello/{r}" for r in others]
    deadline = time.monotonic() + timeout_s

    def fail(what: str, keys) -> StartHandshakeError:
        missing = [r for r, key in zip(others, keys) if not store.check([key])]
        return StartHandshakeError(f"rank 0: rank(s) {missing} of this start did not {what} in the rendezvous "
                                   f"store within {timeout_s:g} s (distributed.timeout_s)")

    try:  # the first start: until every rank said hello; a later one: at once (a dead start's hellos)
        store.wait(hellos, timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:
        raise fail("say hello", hellos) from e
    answered: dict[int, str] = {}
    replies: list[str] = []
    while store.add(f"{_ROOT}/{token}/joined", 0) < world_size - 1:
        if time.monotonic() > deadline:
            raise fail("join", [f"{_ROOT}/{token}/joined/{r}" for r in others])
        for r, value in zip(others, store.multi_get(hellos)):
            nonce = value.decode()
            if answered.get(r) != nonce:  # a rank of this start, or one of a dead start not yet overwritten
                store.set(f"{_ROOT}/reply/{nonce}", token)
                answered[r] = nonce
                replies.append(f"{_ROOT}/reply/{nonce}")
        time.sleep(_POLL_S)
    for key in replies:  # every rank read its answer before it joined; the others were a dead start's
        store.delete_key(key)
    return token
