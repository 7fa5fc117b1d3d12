"""Config section ``resiliency``: how a run comes back from a failed rank.

``restart=launcher`` (the default) leaves restarts to the launcher (``torchrun --max-restarts``,
``ft_launcher``): every rank starts again as a new process. ``restart=in-process`` keeps the healthy
ranks' processes (interpreter, imports, host memory) and restarts the training function inside
them with nvidia-resiliency-ext's ``inprocess.Wrapper`` (:mod:`tierstack.resiliency.in_process`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from tierstack.config.base import _Section

RESTART_MODES = ("launcher", "in-process")  # resiliency.restart
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"  # torchrun's --max-restarts, as each rank sees it


@dataclass(kw_only=True)
class ResiliencyConfig(_Section):
    """Restart of a failed rank: by the launcher (new processes) or in-process (healthy ranks stay)."""

    restart: str = "launcher"  # "launcher" | "in-process"
    # Seconds a rank may go without progress (NVRx's watchdog pings while its main thread runs
    # Python; armed from each attempt's first step) before it is taken as hung: the ranks restart,
    # and it is killed and replaced after half as long again (at least 0.5 s) if it does not answer.
    # Needed by restart=in-process (a hung rank is only found by this timeout); null = none.
    heartbeat_timeout_s: Optional[float] = None
    # Warm spare ranks started with the job (torchrun --nproc-per-node counts them): imports done,
    # they wait to take the rank of a process that died. Active ranks = processes - spares. On
    # several nodes the spares are split evenly: each node keeps spare_ranks / nodes of its own, so a
    # rank is replaced on its node (its node-local files and node memory are there).
    spare_ranks: int = 0
    # In-process restarts allowed before the job fails (then the launcher's restart, if any, follows).
    max_in_process_restarts: int = 8

    @property
    def in_process(self) -> bool:
        """True when ``restart=in-process``."""
        return self.restart == "in-process"

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.restart not in RESTART_MODES:
            p.append(f"resiliency.restart={self.restart!r}: use one of {', '.join(RESTART_MODES)}")
        if self.heartbeat_timeout_s is not None and not self.heartbeat_timeout_s > 0:
            p.append(f"resiliency.heartbeat_timeout_s={self.heartbeat_timeout_s}: must be > 0 (seconds), or null")
        if self.spare_ranks < 0:
            p.append(f"resiliency.spare_ranks={self.spare_ranks}: must be >= 0")
        if self.max_in_process_restarts < 0:
            p.append(f"resiliency.max_in_process_restarts={self.max_in_process_restarts}: must be >= 0")
        if not self.in_process:
            if self.spare_ranks:
                p.append(f"resiliency.spare_ranks={self.spare_ranks} needs resiliency.restart=in-process "
                         "(the launcher's restart starts new processes: it has no use for spares)")
            return p
        if self.heartbeat_timeout_s is None:
            p.append("resiliency.heartbeat_timeout_s is not set: resiliency.restart=in-process needs it (seconds "
                     "without progress before a rank counts as hung; e.g. resiliency.heartbeat_timeout_s=3)")
        return p

    def spares_per_node(self, world_size: int, environ: Optional[dict] = None) -> tuple[int, int, int]:
        """``(nodes, processes per node, spares per node)`` of a launch of ``world_size`` processes,
        from torchrun's ``LOCAL_WORLD_SIZE`` (absent: one node). The spares are split evenly over
        the nodes (a remainder is refused by :meth:`launcher_problems`)."""
        env = os.environ if environ is None else environ
        per_node = int(env.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
        nodes = max(1, world_size // per_node)
        return nodes, per_node, max(0, self.spare_ranks) // nodes

    def spare_split_problems(self, world_size: int, environ: Optional[dict] = None) -> list[str]:
        """The spares leave no rank that trains, or cannot be split evenly over the nodes of a launch
        of ``world_size`` processes (then the ranks that train, and so every rule of the layout, are
        unknown: report this alone). An even split of fewer spares than processes leaves each node
        a rank that trains."""
        if not self.in_process:
            return []
        if self.spare_ranks >= world_size:
            return [f"resiliency.spare_ranks={self.spare_ranks}: must be < the {world_size} processes started "
                    "(torchrun --nproc-per-node counts the spares too)"]
        nodes, _, _ = self.spares_per_node(world_size, environ)
        if nodes > 1 and self.spare_ranks % nodes:
            return [f"resiliency.spare_ranks={self.spare_ranks}: must be a multiple of the {nodes} nodes (each node "
                    "keeps the same number of spares, so that a rank is replaced on its own node)"]
        return []

    def active_ranks_per_node(self, world_size: int, environ: Optional[dict] = None) -> Optional[int]:
        """Ranks that train on each node under in-process restart (processes per node minus that
        node's spares); None without it (every process trains: the layout's default)."""
        if not self.in_process:
            return None
        _, per_node, spares = self.spares_per_node(world_size, environ)
        return max(1, per_node - spares)

    def launcher_problems(self, world_size: int, environ: Optional[dict] = None) -> list[str]:
        """Rules that need the launch: ``world_size`` processes started (spares included).

        In-process restart replaces a dead process with a warm spare; without spares only the
        launcher can (``torchrun --max-restarts N`` with N >= 1). With neither, a rank that dies
        cannot be replaced, and the in-process restart would wait for it in vain: refused. On
        several nodes each node keeps the same number of spares (``spare_ranks`` divisible by the
        nodes).
        """
        if not self.in_process:
            return []
        env = os.environ if environ is None else environ
        p = self.spare_split_problems(world_size, env)
        outer = int(env.get(MAX_RESTARTS_ENV, "0") or 0)
        if self.spare_ranks == 0 and outer == 0:
            p.append("resiliency.spare_ranks=0 with a launcher that cannot replace a process "
                     f"({MAX_RESTARTS_ENV}={env.get(MAX_RESTARTS_ENV, '<unset>')}): a rank that dies would never "
                     "come back; set resiliency.spare_ranks >= 1 (and start that many more processes) or launch "
                     "with --max-restarts >= 1 (torchrun's, or tierstack's own launcher's)")
        return p
