"""One rank of the legacy round trip, launched with ``torchrun --nproc-per-node 2``.

Usage: resave_worker.py [section.field=value ...]  (the ``gpt_tiny`` recipe's overrides)

Resumes exactly as ``tierstack pretrain gpt_tiny`` does (the real setup: model, DistributedOptimizer,
scheduler, the checkpoint manager's resume from ``checkpoint.load``), then saves what it loaded, before
any step, as a GLOBAL checkpoint into ``checkpoint.save`` with this release's writer. With
``train.train_iters`` equal to the resumed step the run then ends without training. The test compares
the two checkpoints tensor by tensor: equal bytes mean that nothing changed on the way in.
"""

from tierstack.checkpointing import CheckpointTier
from tierstack.checkpointing.types import TrainingObjects
from tierstack.recipes import gpt_tiny_config, run
from tierstack.training import setup as setup_mod

_real_setup = setup_mod.setup


def _setup_then_resave(cfg, **kwargs):
    s = _real_setup(cfg, **kwargs)
    objs = TrainingObjects(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, train_state=s.train_state)
    # the manager saves a step once per tier and counts the resumed step as saved: this worker
    # saves it again on purpose, into another root
    s.checkpoint_manager._last_saved[CheckpointTier.GLOBAL] = None
    s.checkpoint_manager.save(CheckpointTier.GLOBAL, objs)
    s.checkpoint_manager.wait()
    return s


if __name__ == "__main__":
    setup_mod.setup = _setup_then_resave
    raise SystemExit(run(gpt_tiny_config))
