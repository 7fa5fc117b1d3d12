"""Where the warm spares of in-process restart are (:mod:`tierstack.resiliency.in_process`): each
node keeps ``resiliency.spare_ranks / nodes`` of its own, and a rank is replaced on its node."""

from __future__ import annotations

import os

from tierstack.config import ConfigContainer


def rank_assignment(config: ConfigContainer):
    """NVRx's rank assignment for this launch: a topology tree (``rank_assignment.Tree``) of the
    job and its nodes (torchrun's ``GROUP_RANK``). Each node activates its first ``processes per
    node - spares per node`` processes (node-major: active rank = node x active per node + index);
    its other processes are its spares. A rank that dies is replaced by a spare of *its* node, which
    finds the rank's node-local files and node memory there; healthy ranks keep their ranks. A node
    with no spare left cannot replace it (no spare moves between nodes): the world would shrink,
    which :func:`~tierstack.resiliency.in_process.run` refuses (:class:`~tierstack.resiliency.in_process.RestartLimitReached`, then the launcher's restart)."""
    from nvidia_resiliency_ext.inprocess.rank_assignment import Layer, LayerFlag, Tree

    r = config.resiliency
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    node = os.environ.get("GROUP_RANK", "0")
    return Tree([Layer(min_ranks=1, max_ranks=processes - r.spare_ranks, key_or_fn="job"),
                 Layer(min_ranks=1, max_ranks=r.active_ranks_per_node(processes), key_or_fn=lambda _: node,
                       flag=LayerFlag.RESERVE)])


def is_spare(config: ConfigContainer) -> bool:
    """True in a process that starts as a spare: one of the last ``spares per node`` of its node
    (torchrun's ``LOCAL_RANK``; see :func:`rank_assignment`)."""
    active = config.resiliency.active_ranks_per_node(int(os.environ.get("WORLD_SIZE", "1")))
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) >= active
