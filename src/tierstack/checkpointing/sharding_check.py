"""When a GLOBAL save needs megatron-core's sharding validation, and when it can skip it.

``dist_checkpointing.save(validate_access_integrity=True)`` gathers every rank's shard metadata
(``all_gather_object`` of all ``ShardedTensor``/``ShardedObject`` descriptions) and has rank 0 check
that the main replicas cover each global tensor exactly once. The verdict depends only on that
metadata: keys, global shapes, offsets, fragmentation, replica ids, flattened ranges, dtypes. A
run saves the same structure again and again, so :class:`ShardingValidation` has it validated at a
tier's first save and again only when some rank's structure differs from the one last validated
on it; the ranks agree on that with one all-reduce of a flag, so they always take the same branch
of megatron's collectives. (Measured on the 1 GiB benchmark state: the validation is 0.07-0.25 s
of a save's planning, more than a third of it.) What the skipped saves also skip is megatron's
check that the common (unsharded) state agrees across ranks, which only logs a warning.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from tierstack.runtime import collectives as _dist


def structure_signature(sharded_state_dict: dict) -> str:
    """A digest of the sharded structure of ``sharded_state_dict`` on this rank (factories applied):
    what megatron's sharding validation reads, in the dict's order; tensor values play no part."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    h = hashlib.sha256()
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            fields = ("T", v.key, v.dtype, tuple(v.local_shape), tuple(v.global_shape), tuple(v.global_offset),
                      v.axis_fragmentations, v.replica_id, v.prepend_axis_num, v.flattened_range,
                      v.allow_shape_mismatch)
        elif isinstance(v, ShardedObject):
            fields = ("O", v.key, tuple(v.global_shape), tuple(v.global_offset), v.replica_id)
        else:
            continue
        h.update(repr(fields).encode())
    return h.hexdigest()


class ShardingValidation:
    """Per GLOBAL tier: whether this save must run megatron's sharding validation."""

    def __init__(self) -> None:
        self._validated: Optional[str] = None  # this rank's structure at the last validated save

    def needed(self, sharded_state_dict: dict) -> tuple[bool, str]:
        """Collective: True on every rank when any rank's structure differs from the one it last
        validated (always at the first save). Returns the verdict and this rank's signature, to
        hand to :meth:`passed` once the save that validated it has been planned."""
        signature = structure_signature(sharded_state_dict)
        return _dist.any_true(signature != self._validated), signature

    def passed(self, signature: str) -> None:
        """The save planned with ``signature`` passed megatron's validation (or did not need it)."""
        self._validated = signature
