"""Reading GLOBAL checkpoints (torch_dist): the one loader of resume and of pretrained weights.

:class:`GlobalReader` only reads: it holds no staging buffers, starts no writer and never writes to
the directory it reads, so loading pretrained weights for fine-tuning does not build a second
GLOBAL tier. The GLOBAL tier loads through it too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from tierstack.checkpointing import model_settings, paths, safe_load
from tierstack.checkpointing.errors import CheckpointLoadError  # noqa: F401 - re-exported (its old home)
from tierstack.checkpointing import state as ckpt_state
from tierstack.checkpointing.types import TrainingObjects
from tierstack.config import CheckpointConfig
from tierstack.runtime import ParallelLayout
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


class GlobalReader:
    """Loads GLOBAL checkpoints into training objects (collective: every rank calls it).

    Args:
        cfg: the ``checkpoint`` section (``load_optim``, ``load_rng``, ``fully_parallel_load``).
        parallel_layout: this rank's layout; optimizer and RNG state load only where it allows.
    """

    def __init__(self, cfg: CheckpointConfig, parallel_layout: ParallelLayout) -> None:
        self.cfg = cfg
        self.layout = parallel_layout

    def _load_strategy(self, path: Path):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = get_default_load_sharded_strategy(str(path))
        if self.cfg.fully_parallel_load:
            strategy = FullyParallelLoadStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        return strategy

    def load(self, root: Path, step: int, objs: TrainingObjects, *, model_only: bool = False) -> str:
        """Collective: restore ``objs`` in place from ``<root>/iter_<step>``; returns that path.

        ``model_only``: the model weights alone (fine-tuning from pretrained weights); counters,
        optimizer, LR schedule and RNG keep their fresh values.

        Raises:
            CheckpointLoadError: the load cannot be exact at this topology (see ``_load_optim_decision``).
        """
        from megatron.core import dist_checkpointing

        c = self.cfg
        path = root / paths.step_dir_name(step)
        man = paths.read_json(path / paths.MANIFEST) or {}
        saved, now = man.get("topology", {}), self.layout.topology()
        optim = self._load_optim_decision(man, objs, model_only)
        model_settings.check_load(man, model_settings.model_settings(objs.model), optim=optim, where=str(path))
        rng = c.load_rng and not model_only and man.get("has_rng", True) and saved == now
        if c.load_rng and not model_only and not man.get("has_rng", True):
            ckpt_state.warn_no_rng(step, "global")
        if c.load_rng and not model_only and saved != now:
            log.warning("GLOBAL load: topology changed %s -> %s; per-rank RNG state not restored", saved, now)
        try:
            safe_load.check_global(path)  # never unpickle code a checkpoint brings
        except safe_load.UnsafeCheckpointError as e:
            raise CheckpointLoadError(str(e)) from None
        sd = ckpt_state.build(objs, is_loading=True, optim=optim, rng=rng)
        loaded = dist_checkpointing.load(sd, str(path), sharded_strategy=self._load_strategy(path))
        if model_only:
            with torch.no_grad():
                ckpt_state.unwrap(objs.model[0]).load_state_dict(loaded[ckpt_state.MODEL], strict=True)
                for opt in ckpt_state.inner_optimizers(objs.optimizer):
                    if hasattr(opt, "reload_model_params"):
                        opt.reload_model_params()
        else:
            ckpt_state.apply(objs, loaded, optim=optim, rng=rng)
        return str(path)

    def _load_optim_decision(self, man: dict, objs: TrainingObjects, model_only: bool) -> bool:
        """Whether to load optimizer state; a load that cannot be exact is an error, never a silent reset."""
        if model_only or not self.cfg.load_optim:
            return False
        if not man.get("has_optimizer", True):
            raise CheckpointLoadError(
                "checkpoint has no optimizer state (saved with checkpoint.save_optim=false); "
                "set checkpoint.load_optim=false to load the model only"
            )
        saved, now = man.get("topology", {}), self.layout.topology()
        dist_now = ckpt_state.uses_distributed_optimizer(objs.optimizer)
        dist_saved = bool(man.get("distributed_optimizer", False))
        same_mp = all(
            saved.get(k) == now[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        )
        if dist_now != dist_saved:
            raise CheckpointLoadError(
                f"checkpoint optimizer state was saved with use_distributed_optimizer={dist_saved}, this run "
                f"uses {dist_now}; set optimizer.use_distributed_optimizer={dist_saved} or "
                "checkpoint.load_optim=false (model weights only, fresh optimizer)"
            )
        if dist_now and not same_mp:
            raise CheckpointLoadError(
                "DistributedOptimizer state can change data-parallel size only (dp_reshardable), but TP/PP "
                f"changed from {saved.get('tensor_model_parallel_size')}/{saved.get('pipeline_model_parallel_size')}"
                f" to {now['tensor_model_parallel_size']}/{now['pipeline_model_parallel_size']}; "
                "set checkpoint.load_optim=false to load the model weights only"
            )
        return True

    def load_pretrained(self, path: Path, objs: TrainingObjects, *,
                        run_config: Optional[Mapping[str, Any]] = None) -> int:
        """Collective: model weights only from ``path``, a step directory or a GLOBAL root with a tracker.

        With ``run_config`` (the run config as plain dicts), the checkpoint's recorded tokenizer and
        architecture are compared with it first (:func:`~tierstack.checkpointing.compat.check`,
        ``pretrained=True``: the vocabulary padding may differ); nothing is loaded on a difference.

        Returns:
            The step of the checkpoint the weights came from.

        Raises:
            FileNotFoundError: ``path`` is a root without ``latest_checkpointed_iteration.txt``.
            CheckpointMismatchError: another tokenizer or tensor-shaping model field (on every rank).
        """
        root, step = path.parent, paths.parse_step_dir(path.name)
        if step is None:
            root = path
            step = int((path / paths.TRACKER_ITERATION).read_text().strip())
        if run_config is not None:
            from tierstack.checkpointing import compat  # above this module (it imports data.tokenizers)

            step_dir = root / paths.step_dir_name(step)
            compat.check(paths.read_json(step_dir / paths.MANIFEST), run_config, str(step_dir), pretrained=True)
        self.load(root, step, objs, model_only=True)
        if _dist.rank() == 0:
            log.info("loaded pretrained weights of step %d from %s", step, root)
        return step
