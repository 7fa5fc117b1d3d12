"""The checkpoint benchmark's set-up (``scripts/bench_checkpoint.py``): its config at each scale, the
model + optimizer state it saves, and the collective and file helpers every measurement uses."""

from __future__ import annotations

import copy
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

GB = 1e9
CHUNK_BYTES = 64 << 20  # the limits' read and write chunk


# ---------------------------------------------------------------------------------------------- setup
def bench_config(scale: str, root: Path):
    """The default recipe (``tierstack.recipes.gpt_tiny``), or it widened until one rank holds >= 1 GiB."""
    from tierstack.recipes import gpt_tiny_config

    cfg = gpt_tiny_config()
    if scale == "1gib":
        # hidden 256 -> 2048 at TP=2: ~100M parameters per rank, x12 bytes (fp32 weight + Adam m, v).
        # A short sequence and one sample per step keep a step near a second on 2 CPU cores; the
        # state to checkpoint does not depend on the batch.
        cfg.model.hidden_size = 2048
        cfg.model.seq_length = 64
        cfg.train.micro_batch_size = 1
        cfg.train.global_batch_size = 1
    c = cfg.checkpoint
    c.save, c.local_dir = str(root / "global_sync"), str(root / "local")
    c.save_interval = c.local_save_interval = None  # saves are called explicitly
    c.most_recent_k = 1
    c.async_save = False
    cfg.straggler, cfg.mlflow = None, None
    return cfg


def with_checkpoint(cfg, **fields):
    out = copy.deepcopy(cfg)
    for k, v in fields.items():
        setattr(out.checkpoint, k, v)
    return out


def synthetic_batches(cfg, vocab: int):
    """Fixed random tokens, the same on every rank (TP ranks must see the same batch)."""
    g = torch.Generator().manual_seed(0)
    mb, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, vocab, (mb, s + 1), generator=g)
    batch = {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(mb, s),
        "position_ids": torch.arange(s).unsqueeze(0).expand(mb, -1).contiguous(),
    }
    while True:
        yield batch


@dataclass
class Bench:
    cfg: object
    layout: object
    objs: object
    data: object
    root: Path
    state_bytes: int = 0  # this rank
    total_state_bytes: int = 0  # all ranks
    tmpfs: Optional[Path] = None  # LOCAL directory on /dev/shm
    flat: dict = field(default_factory=dict)  # the same tensors, flat, for the peers

    def step(self) -> float:
        """One training step; returns its seconds (slowest rank)."""
        from tierstack.training.forward import gpt_forward_step
        from tierstack.training.loop import BatchShape, train_step

        o = self.objs
        t = self.cfg.train
        shape = BatchShape(micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                           seq_length=self.cfg.model.seq_length, data_parallel_size=self.layout.data_parallel_size)
        t0 = time.perf_counter()
        train_step(gpt_forward_step, self.data, o.model, o.optimizer, o.scheduler, shape)
        o.train_state.step += 1
        return max_over_ranks(time.perf_counter() - t0)


def build(cfg, root: Path) -> Bench:
    from tierstack import runtime
    from tierstack.checkpointing import TrainingObjects
    from tierstack.data.tokenizers import build_tokenizer
    from tierstack.models.gpt import gpt_model_provider
    from tierstack.training.optim import build_model, build_optimizer, build_scheduler
    from tierstack.train_state import TrainState

    d = cfg.distributed
    layout = runtime.initialize_distributed(tensor_model_parallel_size=d.tensor_model_parallel_size,
                                             pipeline_model_parallel_size=d.pipeline_model_parallel_size,
                                             seed=cfg.rng.seed)
    vocab = build_tokenizer(cfg.tokenizer).vocab_size
    model = build_model(cfg, gpt_model_provider(cfg, vocab))
    optimizer = build_optimizer(cfg, model)
    objs = TrainingObjects(model=model, optimizer=optimizer, scheduler=build_scheduler(cfg, optimizer),
                           train_state=TrainState())
    return Bench(cfg, layout, objs, synthetic_batches(cfg, vocab), root)


def flatten_state(objs) -> dict[str, torch.Tensor]:
    """Model + optimizer tensors of this rank, as the checkpointing package assembles them for a save
    (``tierstack.checkpointing.state.build``), flattened to ``{name: tensor}`` and deduplicated."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from tierstack.checkpointing import state as ckpt_state

    sd = ckpt_state.build(objs, is_loading=False, optim=True, rng=False)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj, name: str) -> None:
        if hasattr(obj, "build") and not isinstance(obj, (ShardedTensor, ShardedObject)):
            obj = obj.build()  # ShardedTensorFactory
        if isinstance(obj, ShardedTensor):
            obj = obj.data
        if isinstance(obj, torch.Tensor):
            if obj.numel() and obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                out[name] = obj.detach()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{name}/{i}")

    walk({k: sd[k] for k in (ckpt_state.MODEL, ckpt_state.OPTIMIZER)}, "")
    return out


# --------------------------------------------------------------------------------------------- helpers
def rank() -> int:
    return dist.get_rank()


def _on_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the device the default group's backend moves (NCCL: the rank's GPU; gloo: host)."""
    from tierstack import runtime

    return t.to(runtime.device()) if "nccl" in dist.get_backend() else t


def max_over_ranks(x: float) -> float:
    t = _on_wire(torch.tensor([x], dtype=torch.float64))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_over_ranks(x: int) -> int:
    t = _on_wire(torch.tensor([x], dtype=torch.int64))
    dist.all_reduce(t)
    return int(t.item())


def settle() -> None:
    """Collective: every rank flushes the page cache to the disk (``os.sync``) before a timed save, so
    each save, ours and the peers' alike, starts from the same disk state: nothing dirty and no
    earlier repetition's deletion still to commit (on ext4 a deleted GiB is journal work done
    lazily, which the next writer paid for, whichever saver it was). Not timed."""
    os.sync()
    dist.barrier()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds of ``fn`` on the slowest rank, all ranks starting together."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return max_over_ranks(time.perf_counter() - t0), out


def files_under(path: Path) -> list[Path]:
    return [p for p in Path(path).rglob("*") if p.is_file()] if Path(path).exists() else []


def bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def evict(paths) -> None:
    """Drop the files' pages from the page cache (clean pages only: fsync first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict_all(*roots: Path) -> None:
    """Collective: rank 0 evicts every file under ``roots`` (one node: one page cache)."""
    if rank() == 0:
        evict([p for r in roots for p in files_under(r)])
    dist.barrier()


def remove(path: Path) -> None:
    """Collective: rank 0 removes ``path``."""
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
