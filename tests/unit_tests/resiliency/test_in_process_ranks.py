"""Which process trains as which rank under in-process restart with spares on several nodes: NVRx's
real ``rank_assignment.Tree`` as :func:`spares.rank_assignment` builds it, one instance per
simulated process (each with its own torchrun environment), exchanging their states through a real
store, as NVRx's wrapper calls it at each restart."""

import threading

import pytest
import torch.distributed as dist

from tierstack.config import ConfigContainer, ConfigError
from tierstack.resiliency import in_process
from tierstack.resiliency import spares as spare_layout


def _config(spares: int):
    return ConfigContainer().apply_overrides([
        "train.micro_batch_size=2", "train.global_batch_size=4", "resiliency.restart=in-process",
        "resiliency.heartbeat_timeout_s=3", f"resiliency.spare_ranks={spares}"])


class _Processes:
    """``nodes`` x ``per_node`` processes, each with the rank assignment it builds in its own environment."""

    def __init__(self, monkeypatch, nodes: int, per_node: int, spares: int):
        from nvidia_resiliency_ext.inprocess.state import State
        from nvidia_resiliency_ext.inprocess.store import StoreMixin

        class Store(dist.HashStore, StoreMixin):
            pass

        self.store, n = Store(), nodes * per_node
        self.trees, self.states, self.spare = {}, {}, {}
        for rank in range(n):  # torchrun's environment of each process (node-major global ranks)
            for k, v in dict(WORLD_SIZE=n, LOCAL_WORLD_SIZE=per_node, GROUP_RANK=rank // per_node,
                             LOCAL_RANK=rank % per_node, RANK=rank).items():
                monkeypatch.setenv(k, str(v))
            self.trees[rank] = spare_layout.rank_assignment(_config(spares))
            self.spare[rank] = spare_layout.is_spare(_config(spares))
            self.states[rank] = State(rank=rank, world_size=n)

    def restart(self, terminated: set[int]) -> dict:
        """Every live process assigns its rank after ``terminated`` (initial ranks) died; returns
        initial rank -> (active rank or None for a spare, active world size)."""
        from nvidia_resiliency_ext.inprocess.rank_assignment import RankAssignmentCtx

        dead = {self.states[p].rank for p in terminated}
        for p in terminated:
            del self.states[p]
        out, errors = {}, []

        def one(p):
            try:
                ctx = self.trees[p](RankAssignmentCtx(self.states[p], self.store, set(dead)))
                self.states[p] = ctx.state
                out[p] = (ctx.state.active_rank, ctx.state.active_world_size)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(p,)) for p in list(self.states)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        return out


def test_each_node_trains_its_first_process_and_replaces_a_dead_rank_with_its_own_spare(monkeypatch):
    procs = _Processes(monkeypatch, nodes=2, per_node=2, spares=2)
    assert procs.spare == {0: False, 1: True, 2: False, 3: True}
    first = procs.restart(set())
    assert first == {0: (0, 2), 1: (None, 2), 2: (1, 2), 3: (None, 2)}  # one rank per node, node-major
    # the process of rank 1 (node 1) dies: node 1's spare takes rank 1, rank 0 keeps its rank
    assert procs.restart({2}) == {0: (0, 2), 1: (None, 2), 3: (1, 2)}
    # it dies too: node 1 has no spare left, and node 0's spare is not moved there; the world shrinks
    # (what in_process.run refuses, so that the launcher's restart takes over)
    assert procs.restart({3}) == {0: (0, 1), 1: (None, 1)}


def test_on_one_node_the_last_processes_are_the_spares_as_before(monkeypatch):
    procs = _Processes(monkeypatch, nodes=1, per_node=4, spares=2)
    assert procs.spare == {0: False, 1: False, 2: True, 3: True}
    assert procs.restart(set()) == {0: (0, 2), 1: (1, 2), 2: (None, 2), 3: (None, 2)}
    after = procs.restart({0})  # rank 0 died: a spare takes rank 0, rank 1 keeps its rank
    assert after[1] == (1, 2) and sorted(v for v in after.values() if v[0] is not None) == [(0, 2), (1, 2)]


@pytest.mark.parametrize("spares,per_node,message", [
    (1, 2, "resiliency.spare_ranks=1: must be a multiple of the 2 nodes"),
    (3, 3, "resiliency.spare_ranks=3: must be a multiple of the 2 nodes"),
    (4, 2, "resiliency.spare_ranks=4: must be < the 4 processes started"),
])
def test_spares_that_cannot_be_split_over_the_nodes_are_refused_alone_naming_the_field(spares, per_node, message):
    """Alone: with an odd number of ranks that train, the tensor-parallel, batch and replication
    rules fail too, but only as a consequence (a break-it pass saw a TP divisibility error instead)."""
    cfg = _config(spares).apply_overrides(["distributed.tensor_model_parallel_size=2", "checkpoint.replication_factor=2",
                                           "checkpoint.local_dir=/tmp/x"])
    with pytest.raises(ConfigError) as err:
        in_process.check(cfg, 2 * per_node, environ={"LOCAL_WORLD_SIZE": str(per_node), "TORCHELASTIC_MAX_RESTARTS": "1"})
    assert err.value.problems == [next(p for p in err.value.problems if message in p)], err.value.problems


def test_the_layout_checks_see_the_ranks_that_train_on_each_node():
    """2 nodes x (1 rank + 1 spare), replicas on the other node: allowed (the replication rule
    counts 1 training rank per node, not the 2 processes torchrun started there)."""
    cfg = _config(2).apply_overrides(["checkpoint.replication_factor=2", "checkpoint.local_dir=/tmp/x"])
    in_process.check(cfg, 4, environ={"LOCAL_WORLD_SIZE": "2"})
