"""Two checkpoint tiers (LOCAL, GLOBAL), resume selection, manifests, retention and retries.

The training loop uses :class:`CheckpointManager` only; the rest is here to be read and tested.
"""

from tierstack.checkpointing.errors import CheckpointLoadError
from tierstack.checkpointing.manager import CheckpointManager, CheckpointSaveError
from tierstack.checkpointing.types import (
    CheckpointTier,
    CheckpointTierHandler,
    ResumeInfo,
    SaveEvent,
    TrainingObjects,
)

__all__ = [
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointTier",
    "CheckpointTierHandler",
    "ResumeInfo",
    "SaveEvent",
    "TrainingObjects",
]
