"""The named parts of a checkpoint, shared by both tiers.

A checkpoint is the dict ``{MODEL, OPTIMIZER, SCHEDULER, TRAIN_STATE, RNG}``: model and optimizer as
megatron-core sharded state dicts, scheduler and TrainState as plain values (the "common" part),
and RNG as one ``ShardedObject`` per global rank, since every rank has its own generators.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence, Union

import torch

from tierstack import runtime
from tierstack.checkpointing.types import TrainingObjects
from tierstack.checkpointing.scheduler_state import load_scheduler_state, scheduler_state

log = logging.getLogger(__name__)

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
TRAIN_STATE = "train_state"
RNG = "rng_state"

# DistributedOptimizer format that loads at another DP size without communication (CPU_NOTES:
# the default "fully_sharded_model_space" fails on this stack, "fully_reshardable" fails at load).
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (checkpoint keys must not depend on them)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def inner_optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrappers (or ``optimizer`` itself when it is one):
    their param groups hold the fp32 main parameters (a DistributedOptimizer's: this rank's
    shard) and their state the moments."""
    out = []
    for opt in inner_optimizers(optimizer):
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
    return out


def uses_distributed_optimizer(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in inner_optimizers(optimizer))


def prepare_optimizer_for_load(optimizer: Any) -> None:
    """A DistributedOptimizer that has not stepped has no Adam state to load into; give it one."""
    for opt in inner_optimizers(optimizer):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None:
            init()


def optimizer_state_tensors(optimizer: Any) -> dict[tuple[int, int, str], torch.Tensor]:
    """Every tensor of the inner torch optimizers' per-parameter state (Adam moments, ...), keyed by
    (index in :func:`torch_optimizers`, ``id`` of the parameter, state key)."""
    out = {}
    for i, torch_opt in enumerate(torch_optimizers(optimizer)):
        for p, st in torch_opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[(i, id(p), k)] = v
    return out


@torch.no_grad()
def own_optimizer_state(optimizer: Any, before: dict[tuple[int, int, str], torch.Tensor],
                        source: Union[torch.Tensor, Sequence[torch.Tensor]]) -> int:
    """Make the optimizer state own its memory again after a load from ``source``'s bytes.

    ``torch.optim.Optimizer.load_state_dict`` (and megatron's optimizers, which call it) keeps the
    loaded tensors themselves when dtype and device already match: after a LOCAL load the Adam
    moments would be views of the mapped checkpoint file (:func:`local_file.read_verified`), so the
    first step after a resume would pay a copy-on-write fault per page it updates, and the file
    could not free its space after retention deletes it. Each such tensor is copied back into the
    tensor the optimizer held before the load (``before``: :func:`optimizer_state_tensors` after
    :func:`prepare_optimizer_for_load`; same shape and dtype), or cloned where there is none.

    Args:
        source: the tensor whose memory the loaded tensors may view (a file's 1-D uint8 bytes),
            or several (the held buffers of a step in memory): the state is walked once.

    Returns:
        Bytes copied.
    """
    import bisect

    spans = sorted((s.data_ptr(), s.data_ptr() + s.numel() * s.element_size())
                   for s in ([source] if isinstance(source, torch.Tensor) else source))
    starts = [lo for lo, _ in spans]

    def inside(ptr: int) -> bool:  # in one of the sources' bytes (a bisect: one look per tensor)
        j = bisect.bisect_right(starts, ptr) - 1
        return j >= 0 and ptr < spans[j][1]

    copied = 0
    for i, torch_opt in enumerate(torch_optimizers(optimizer)):
        for p, st in torch_opt.state.items():
            for k, t in list(st.items()):
                if not isinstance(t, torch.Tensor) or not inside(t.data_ptr()):
                    continue
                old = before.get((i, id(p), k))
                if old is not None and old.shape == t.shape and old.dtype == t.dtype and not inside(old.data_ptr()):
                    st[k] = old.copy_(t)
                else:
                    st[k] = t.clone()
                copied += t.numel() * t.element_size()
    return copied


def rng_object(world_size: int, rank: int, state: Any):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(RNG, state, (world_size,), (rank,), replica_id=0)


def warn_no_rng(step: int, tier: str) -> None:
    """Say once, on rank 0, that a resume cannot be exact because the checkpoint holds no RNG state."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    log.warning(
        "%s checkpoint of step %d was saved with checkpoint.save_rng=false: RNG state not restored, "
        "so dropout and other random draws after this resume differ from an uninterrupted run", tier, step,
    )


def build(objs: TrainingObjects, *, is_loading: bool, optim: bool, rng: bool) -> dict:
    """The sharded state dict to save (or to load into when ``is_loading``)."""
    if len(objs.model) != 1:
        raise NotImplementedError("tierstack checkpoints one model chunk per rank (no virtual pipeline)")
    model_sd = unwrap(objs.model[0]).sharded_state_dict()
    sd: dict = {
        MODEL: model_sd,
        SCHEDULER: scheduler_state(objs.scheduler),
        TRAIN_STATE: objs.train_state.state_dict(),
    }
    if optim:
        if is_loading:
            prepare_optimizer_for_load(objs.optimizer)
        sd[OPTIMIZER] = objs.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_METADATA)
        if not is_loading:
            zero_padding(sd[OPTIMIZER])
    if rng:
        ws = torch.distributed.get_world_size()
        sd[RNG] = rng_object(ws, torch.distributed.get_rank(), runtime.get_rng_state() if not is_loading else None)
    return sd


def zero_padding(tree: Any) -> None:
    """Zero the padding shards of a DistributedOptimizer's sharded state dict (in place).

    megatron-core's ``dp_reshardable`` format covers the gaps between parameters in its buffers
    (a parameter's size not a multiple of the bucket alignment) with ``torch.empty`` tensors of
    ``param``, ``exp_avg`` and ``exp_avg_sq`` marked ``'padding': True`` (megatron-core 0.16.1,
    ``DistributedOptimizer.sharded_param_state_dp_reshardable``). Their bytes are whatever that
    memory held: written as they are, a checkpoint differs from run to run, and the non-finite
    check of the staged state (:func:`~tierstack.checkpointing.nonfinite_guard.check_staged`)
    would read NaN bit patterns that no parameter holds. The tensors are fresh per build, so
    zeroing them changes no training state.
    """
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(tree, dict):
        flag = tree.get("padding")
        if isinstance(flag, LocalNonpersistentObject) and flag.obj is True:
            for v in tree.values():
                if isinstance(v, ShardedTensor) and v.data is not None:
                    v.data.zero_()
        children = tree.values()
    elif isinstance(tree, (list, tuple)):
        children = tree
    else:
        return
    for v in children:
        zero_padding(v)


@torch.no_grad()  # a DistributedOptimizer's fp32 main params are views of leaves that require grad
def apply(objs: TrainingObjects, loaded: dict, *, optim: bool, rng: bool) -> None:
    """Restore ``objs`` in place from a loaded state dict."""
    unwrap(objs.model[0]).load_state_dict(loaded[MODEL], strict=True)
    if optim:
        _match_saved_group_lrs(objs.optimizer, loaded[SCHEDULER])
        objs.optimizer.load_state_dict(loaded[OPTIMIZER])
        _restore_per_param_adam_steps(objs.optimizer)
    else:
        # Model-only load: the optimizer's fp32 copies must follow the loaded weights.
        for opt in inner_optimizers(objs.optimizer):
            reload = getattr(opt, "reload_model_params", None)
            if reload is not None:
                reload()
    load_scheduler_state(objs.scheduler, objs.optimizer, loaded[SCHEDULER])
    objs.train_state.load_state_dict(loaded[TRAIN_STATE])
    if rng and loaded.get(RNG) is not None:
        runtime.set_rng_state(loaded[RNG])


def _match_saved_group_lrs(optimizer: Any, scheduler_sd: dict) -> None:
    """Give this run's param groups the checkpoint's ``max_lr``/``min_lr`` before its optimizer state loads.

    megatron-core 0.19 matches the saved param groups to the current ones by an identifier that
    includes ``max_lr`` and ``min_lr`` (``MegatronOptimizer._filter_and_reorder_param_groups``), so a
    resume with another ``optimizer.lr`` or ``optimizer.min_lr`` found no group and raised. The
    checkpoint's values come from its scheduler state (tierstack gives every group the same two);
    after the load the groups hold the checkpoint's values, and ``load_scheduler_state`` applies this
    config's instead when ``scheduler.override_opt_param_scheduler`` says so, as before.
    """
    max_lr, min_lr = scheduler_sd.get("max_lr"), scheduler_sd.get("min_lr")
    for opt in inner_optimizers(optimizer):
        for group in getattr(getattr(opt, "optimizer", None), "param_groups", []):
            if max_lr is not None and "max_lr" in group:
                group["max_lr"] = max_lr
            if min_lr is not None and "min_lr" in group:
                group["min_lr"] = min_lr


def _restore_per_param_adam_steps(optimizer: Any) -> None:
    """DistributedOptimizer restores Adam's step count into ``param_groups[i]["step"]`` (what fused
    Adam kernels read), while torch's Adam (the CPU fallback) reads ``state[p]["step"]``, left at the
    dummy value 1 by the pre-load initialisation. Without this the bias correction after a resume
    is that of step 1 and the run is no longer exact."""
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for group in torch_opt.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                st = torch_opt.state.get(p)
                old = st.get("step") if st else None
                if isinstance(old, torch.Tensor):
                    # A new tensor per parameter: the dummy initialisation may share one, and Adam
                    # increments each parameter's step in place.
                    st["step"] = torch.tensor(float(group["step"]), dtype=old.dtype, device=old.device)
