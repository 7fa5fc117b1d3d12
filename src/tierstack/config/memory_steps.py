"""The checks of ``checkpoint.memory_save_interval`` and ``checkpoint.memory_dir`` (LOCAL memory
steps: :mod:`tierstack.checkpointing.local_memory`), one message per problem."""

from __future__ import annotations

import os
from typing import Any


def memory_step_problems(c: Any) -> list[str]:
    """What is wrong with ``c``'s (a ``CheckpointConfig``) memory-step fields; [] when nothing is."""
    m, local, d = c.memory_save_interval, c.local_save_interval, c.memory_dir
    p = []
    if d is not None and m is None:
        p.append(f"checkpoint.memory_dir={d} is set but checkpoint.memory_save_interval is not (it holds memory steps)")
    if d is not None and not os.path.isabs(d):
        p.append(f"checkpoint.memory_dir={d}: give an absolute path in the node's shared memory (e.g. /dev/shm)")
    if m is None:
        return p
    if m < 1:
        return p + [f"checkpoint.memory_save_interval={m}: must be >= 1 iterations, or null"]
    if c.local_dir is None:
        return p + [f"checkpoint.memory_save_interval={m} needs checkpoint.local_dir (memory steps belong to the LOCAL tier)"]
    if isinstance(local, int) and local >= 1 and m % local == 0:
        p.append(f"checkpoint.memory_save_interval={m} is a multiple of checkpoint.local_save_interval={local}: every "
                 "memory step falls on a LOCAL file save and none is ever taken; use a smaller interval (e.g. 1)")
    return p
