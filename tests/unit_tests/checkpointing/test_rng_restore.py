"""A resume restores the RNG state the checkpoint holds (python, numpy, torch and megatron-core's
tracker): the draws after the restore are those that followed the save. Real megatron-core
scheduler over a real torch Adam, real ``get_rng_state``/``set_rng_state``."""

import random

import numpy as np
import torch

from tierstack import runtime
from tierstack.checkpointing import state as ckpt_state
from tierstack.checkpointing.types import TrainingObjects
from tierstack.recipes import gpt_tiny_config
from tierstack.train_state import TrainState
from tierstack.training.optim import build_scheduler, scheduler_state


def _objs():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(gpt_tiny_config(), optimizer)
    return TrainingObjects(model=[model], optimizer=optimizer, scheduler=scheduler, train_state=TrainState())


def _draws():
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_the_loaded_rng_state_is_restored_and_not_without_rng():
    objs = _objs()
    loaded = {ckpt_state.MODEL: objs.model[0].state_dict(), ckpt_state.SCHEDULER: scheduler_state(objs.scheduler),
              ckpt_state.TRAIN_STATE: objs.train_state.state_dict(), ckpt_state.RNG: runtime.get_rng_state()}
    after_save = _draws()
    _draws()  # the run went on: the generators moved
    ckpt_state.apply(objs, loaded, optim=False, rng=True)
    assert _draws() == after_save
    ckpt_state.apply(objs, loaded, optim=False, rng=False)  # load_rng=false: the generators stay where they are
    assert _draws() != after_save
