"""Build a megatron-core model outside a training job and move GLOBAL checkpoints in and out of it.

Conversion and generation build the same objects a training run builds (``training.setup``'s
model, optimizer and LR schedule). They save only through the checkpoint package's public
:class:`~tierstack.checkpointing.CheckpointManager`, so manifests, trackers and run configs are
exactly those of a training run, and read weights through the read-only
:class:`~tierstack.checkpointing.global_reader.GlobalReader` a run's pretrained start uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from pathlib import Path
from typing import Iterator, Optional

from tierstack.checkpointing import paths as ckpt_paths
from tierstack.config import CheckpointConfig, ConfigContainer


class CheckpointNotFoundError(FileNotFoundError):
    """``--load`` names no published GLOBAL checkpoint; the message names the path."""


def resolve_step_dir(load: str | Path) -> Path:
    """A published step directory from ``ROOT`` (its tracker's newest step) or ``ROOT/iter_N``.

    Raises:
        CheckpointNotFoundError: no such directory, no tracker, or no ``run_config.yaml`` in it.
    """
    path = Path(load)
    if ckpt_paths.parse_step_dir(path.name) is None:
        tracker = path / ckpt_paths.TRACKER_ITERATION
        if not tracker.is_file():
            raise CheckpointNotFoundError(
                f"--load {path}: neither a step directory (iter_NNNNNNN) nor a GLOBAL root with {tracker.name}"
            )
        path = path / ckpt_paths.step_dir_name(int(tracker.read_text().strip()))
    for needed in (ckpt_paths.MANIFEST, ckpt_paths.RUN_CONFIG):
        if not (path / needed).is_file():
            raise CheckpointNotFoundError(f"--load {path}: no {needed} (not a published GLOBAL checkpoint)")
    return path


def read_run_config(step_dir: Path) -> ConfigContainer:
    """The ``ConfigContainer`` a checkpoint was saved with (its ``run_config.yaml``)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(step_dir / ckpt_paths.RUN_CONFIG), resolve=True)
    return ConfigContainer.from_dict(data)  # type: ignore[arg-type]


def saved_padded_vocab_size(step_dir: Path) -> int:
    """Rows of the embedding as saved (vocabulary padded for the TP it was saved with)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(step_dir))
    for key, sh in meta.items():
        if key.endswith("embedding.word_embeddings.weight"):
            return int(sh.global_shape[0])
    raise CheckpointNotFoundError(f"{step_dir}: no embedding.word_embeddings.weight in the checkpoint")


@contextlib.contextmanager
def parallel_world(cfg: ConfigContainer) -> Iterator:
    """Process groups for ``cfg.distributed`` (a 1-rank group outside torchrun), torn down on exit.

    Groups that already exist (a caller's) are reused and left alone.

    Raises:
        ValueError: existing groups have another TP/PP than ``cfg`` asks for.
    """
    import torch.distributed as dist

    from tierstack import runtime

    d = cfg.distributed
    if dist.is_initialized():
        lay = runtime.current_layout()
        if (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size) != (
            d.tensor_model_parallel_size, d.pipeline_model_parallel_size
        ):
            raise ValueError(
                f"process groups exist with TP={lay.tensor_model_parallel_size} PP={lay.pipeline_model_parallel_size}; "
                f"this needs TP={d.tensor_model_parallel_size} PP={d.pipeline_model_parallel_size}"
            )
        yield lay
        return
    from tierstack.runtime import cpu_compat

    compat_was_active = cpu_compat.is_active()
    lay = runtime.initialize_distributed(
        tensor_model_parallel_size=d.tensor_model_parallel_size,
        pipeline_model_parallel_size=d.pipeline_model_parallel_size,
        seed=cfg.rng.seed,
        backend=d.backend,
        timeout_s=d.timeout_s,
    )
    try:
        yield lay
    finally:
        runtime.destroy_distributed()
        if not compat_was_active:  # leave the process as it was (conversion inside a larger program)
            cpu_compat.deactivate()


def build_objects(cfg: ConfigContainer, vocab_size: int):
    """Model (megatron DDP over one ``GPTModel`` stage), optimizer, LR schedule and a fresh TrainState.

    Args:
        vocab_size: embedding rows; padded by the provider to a multiple of
            ``make_vocab_size_divisible_by * TP`` (an already padded size stays as it is).
    """
    from tierstack.checkpointing import TrainingObjects
    from tierstack.models.gpt import gpt_model_provider
    from tierstack.train_state import TrainState
    from tierstack.training.optim import build_model, build_optimizer, build_scheduler

    provider = gpt_model_provider(cfg, vocab_size)
    model = build_model(cfg, provider)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    return TrainingObjects(model=model, optimizer=optimizer, scheduler=scheduler, train_state=TrainState())


def load_model_weights(cfg: ConfigContainer, step_dir: Path):
    """Build a model at ``cfg.distributed``'s TP/PP and load a GLOBAL checkpoint's weights into it.

    The checkpoint may have been saved at any TP/PP/DP: megatron-core reshards it. Read-only (the
    :class:`GlobalReader` a run's pretrained start uses; no tier, no writer). Collective when
    several ranks run. Returns the ``TrainingObjects`` (weights loaded; counters and optimizer fresh).
    """
    from tierstack import runtime
    from tierstack.checkpointing.global_reader import GlobalReader

    objs = build_objects(cfg, saved_padded_vocab_size(step_dir))
    GlobalReader(CheckpointConfig(), runtime.current_layout()).load_pretrained(Path(step_dir), objs)
    for chunk in objs.model:
        chunk.eval()
    return objs


def save_global(cfg: ConfigContainer, objs, save_root: Path) -> Path:
    """Publish ``objs`` as a GLOBAL checkpoint of step ``objs.train_state.step`` under ``save_root``.

    Model weights only (no optimizer state, no RNG): the checkpoint is a start for training, not a
    resume point. Returns the published step directory.
    """
    from tierstack import runtime
    from tierstack.checkpointing import CheckpointManager, CheckpointTier
    from tierstack.runtime import collectives

    ckpt = CheckpointConfig(save=str(save_root), async_save=False, save_optim=False, save_rng=False, most_recent_k=-1)
    run = dataclasses.replace(cfg, checkpoint=ckpt)
    if not objs.train_state.run_id:
        objs.train_state.run_id = collectives.broadcast_object(uuid.uuid4().hex[:12])
    manager = CheckpointManager(ckpt, runtime.current_layout(), run_config=run.to_dict())
    try:
        manager.save(CheckpointTier.GLOBAL, objs)
    except BaseException as e:
        manager.close(e)  # not collective unless every rank raised it alike
        raise
    manager.close()
    path = Path(save_root) / ckpt_paths.step_dir_name(objs.train_state.step)
    if not (path / ckpt_paths.MANIFEST).is_file():
        raise RuntimeError(f"GLOBAL checkpoint {path} was not published (see the log above)")
    return path


def torchrun_world_size() -> Optional[int]:
    """``WORLD_SIZE`` under torchrun, None in a plain process."""
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws else None
