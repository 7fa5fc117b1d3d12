"""Checkpoint performance: tierstack's two tiers against the machine's limits and PyTorch's own savers.

Everything is measured in one run, on the same model + optimizer state, on every rank at once
(throughputs are aggregate over ranks: all ranks' bytes / the slowest rank's time):

1. Limits: ``copy_`` of the state size into a preallocated buffer (what a snapshot costs at least),
   durable write (write + fsync) into the save directory, cold read (page cache evicted with
   ``posix_fadvise(DONTNEED)``), and the bytes of model + optimizer state per rank. Beside them the
   non-finite guard's checks per checkpoint boundary (on the loop; on the writer thread), as ratios
   to the copy.
2. Ours (``CheckpointManager``): blocking time of a GLOBAL sync save, a GLOBAL async save, a LOCAL
   save (on the save directory's disk and on a tmpfs, ``/dev/shm``); the time to durable (written,
   fsync'd, sealed on every rank; GLOBAL: published); for each background save, the extra time of the
   training steps that run while its writer does; the staging memory each tier keeps and the resident
   memory growth from save 2 to save N; resume from each tier, warm and with the checkpoint evicted
   from the page cache.
3. Peers on the same tensors: ``torch.save`` per rank (+ fsync), ``torch.distributed.checkpoint.save``
   and ``async_save`` (FileSystemWriter, which fsyncs).

Each figure is the median of ``--reps`` repetitions, with min and max; ratios are medians over medians.

Run: .venv/bin/torchrun --nproc-per-node 2 scripts/bench_checkpoint.py [--scale default|1gib] [--reps N]
     [--only global]  (the GLOBAL figures paired with dcp only)
     [--profile global-sync|global-async|local|resume-global|resume-local]  (cProfile on rank 0, one save)
"""

from __future__ import annotations

import argparse
import copy
import gc
import cProfile
import io
import logging
import os
import pstats
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

GB = 1e9
_CHUNK = 64 << 20


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


# ---------------------------------------------------------------------------------------------- limits
def measure_limits(b: Bench, reps: int) -> dict[str, list[float]]:
    n = b.state_bytes
    src = torch.empty(n, dtype=torch.uint8).fill_(7)
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)  # touched: no page faults in the timed copy
    d = b.root / "limits"
    if rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    path = d / f"rank{rank()}.bin"
    src_view, dst_view = memoryview(src.numpy()), memoryview(dst.numpy())

    def write():
        with open(path, "wb", buffering=0) as f:
            for off in range(0, n, _CHUNK):
                f.write(src_view[off:off + _CHUNK])
            os.fsync(f.fileno())

    def read():
        with open(path, "rb", buffering=0) as f:
            for off in range(0, n, _CHUNK):
                f.readinto(dst_view[off:off + _CHUNK])

    out: dict[str, list[float]] = {"memcpy": [], "clone": [], "write": [], "read_cold": []}
    for _ in range(reps):
        out["memcpy"].append(timed(lambda: dst.copy_(src))[0])
        # Not a limit: what a snapshot into freshly allocated memory pays (first-touch page faults).
        out["clone"].append(timed(lambda: src.clone())[0])
        out["write"].append(timed(write)[0])
        evict([path])
        out["read_cold"].append(timed(read)[0])
        path.unlink()
    del src_view, dst_view
    remove(d)
    return out


# ------------------------------------------------------------------------------------------------ guard
def measure_guard(b: Bench, reps: int) -> dict[str, list[float]]:
    """The non-finite guard's cost per checkpoint boundary: on the training loop
    (:meth:`NonFiniteGuard.check`, the interval's per-step flags, one all-reduce) and on a tier's
    writer thread (:func:`check_staged`, a pass over every floating-point tensor of the state that
    is written, off the loop); beside them the check that once ran on the loop (per-tensor max and
    min of every parameter and gradient, one all-reduce)."""
    from tierstack.checkpointing.nonfinite_guard import NonFiniteGuard, check_staged
    from tierstack.runtime import collectives

    guard = NonFiniteGuard("skip")
    state = list(b.flat.values())

    def previous_preflight() -> bool:
        ext = [x for c in b.objs.model for p in c.parameters() for t in (p, getattr(p, "main_grad", p.grad))
               if t is not None and t.numel() for x in (t.detach().amax().float(), t.detach().amin().float())]
        return collectives.all_true(bool(torch.isfinite(torch.stack(ext)).all()))

    out: dict[str, list[float]] = {"guard": [], "staged": [], "preflight": []}
    for i in range(reps):
        out["guard"].append(timed(lambda: guard.check(-1 - i))[0])  # a new step: no cached verdict
        out["staged"].append(timed(lambda: check_staged(state, "bench"))[0])
        out["preflight"].append(timed(previous_preflight)[0])
    return out


# ------------------------------------------------------------------------------------------------ ours
def measure_global_sync(b: Bench, mgr, reps: int) -> dict[str, list[float]]:
    from tierstack.checkpointing import CheckpointTier

    out: dict[str, list[float]] = {"blocking": [], "bytes": [], "paired dcp.save": []}
    for i in range(reps):
        # the peer at once, on the same state and page cache: a ratio per pair, free of drift; the
        # order alternates so that neither side always follows the other's deletions and writeback
        if i % 2:
            out["paired dcp.save"].append(peer_rep(b, "dcp.save", b.root / "paired")[1])
        b.objs.train_state.step += 1
        s, _ = timed(lambda: mgr.save(CheckpointTier.GLOBAL, b.objs))
        out["blocking"].append(s)  # sync: returns after fsync, manifest, rename, trackers
        out["bytes"].append(mgr.events[-1].bytes)
        mgr.wait()  # the retention it started (background, overlapping training) does not reach the next rep
        if not i % 2:
            out["paired dcp.save"].append(peer_rep(b, "dcp.save", b.root / "paired")[1])
    return out


def measure_async(b: Bench, mgr, tier, reps: int, max_steps: int) -> dict[str, list[float]]:
    """Per repetition, two saves of ``tier`` (asynchronous in the background writer):

    1. save, then ``wait()`` at once: the blocking time and the time to durable (written, fsync'd,
       sealed on every rank / published), with nothing competing for the CPU;
    2. save, then train (``maybe_save`` after each step finalizes, as the loop does) until the save
       is sealed: the extra time of those steps over a step without a save (GIL, memory bandwidth
       and cores shared with the writer).
    """
    from tierstack.checkpointing import CheckpointTier

    out: dict[str, list[float]] = {k: [] for k in ("blocking", "durable", "extra", "steps", "base", "bytes")}
    for _ in range(reps):
        b.objs.train_state.step += 1
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(tier, b.objs)
        blocking = max_over_ranks(time.perf_counter() - t0)
        mgr.wait()  # also waits for the retention this save started (not part of "durable")
        out["durable"].append(max_over_ranks(mgr.last_durable_s(tier)))
        out["blocking"].append(blocking)
        out["bytes"].append(saved_bytes(b, mgr, tier))
        if tier is CheckpointTier.GLOBAL:  # its peers at once, on the same state and page cache
            blocking_a, durable_a, _ = peer_rep(b, "dcp.async_save", b.root / "paired")
            out.setdefault("paired dcp.async_save blocking", []).append(blocking_a)
            out.setdefault("paired dcp.async_save durable", []).append(durable_a)
            out.setdefault("paired dcp.save", []).append(peer_rep(b, "dcp.save", b.root / "paired")[1])
        base = statistics.median(b.step() for _ in range(2))
        b.objs.train_state.step += 1
        mgr.save(tier, b.objs)
        steps: list[float] = []
        # until the save is durable and the retention it started (deleting the oldest checkpoint,
        # on the tier's retention thread) has ended: both compete with these steps
        while (mgr.in_flight(tier) or max_over_ranks(float(mgr.retention_pending(tier))) > 0) and len(steps) < max_steps:
            t1 = time.perf_counter()
            b.step()
            mgr.maybe_save(b.objs)  # intervals are off: this only finalizes finished saves
            steps.append(max_over_ranks(time.perf_counter() - t1))
        mgr.wait()
        out["extra"].append(sum(steps) - base * len(steps))
        out["steps"].append(len(steps))
        out["base"].append(base)
    return out


def saved_bytes(b: Bench, mgr, tier) -> int:
    """Bytes of the checkpoint of the current step, all ranks."""
    from tierstack.checkpointing import CheckpointTier

    if tier is CheckpointTier.GLOBAL:
        return mgr.events[-1].bytes
    rank_dir = Path(mgr.cfg.local_dir) / str(rank())
    mine = [p for p in files_under(rank_dir) if f"iter_{b.objs.train_state.step:07d}_" in p.name]
    return sum_over_ranks(sum(p.stat().st_size for p in mine))


def measure_rss(b: Bench, mgr, tier, saves: int) -> tuple[int, int, int]:
    """Resident memory of this process after save 2 and after save ``saves`` of ``tier`` (each
    waited for), and the staging bytes the tier holds; the largest growth over ranks."""
    import psutil

    proc, rss = psutil.Process(), {}
    for n in range(1, saves + 1):
        b.objs.train_state.step += 1
        mgr.save(tier, b.objs)
        mgr.wait()
        rss[n] = proc.memory_info().rss
    growth = max_over_ranks(float(rss[saves] - rss[2]))
    return rss[2], int(growth), mgr.staging_bytes(tier)


def measure_resume(b: Bench, cfg, roots: list[Path], reps: int, expect) -> dict[str, list[float]]:
    """Resume through a fresh CheckpointManager whose config sees one tier only."""
    from tierstack.checkpointing import CheckpointManager

    out: dict[str, list[float]] = {"cold": [], "warm": []}
    for _ in range(reps):
        for kind in ("cold", "warm"):
            if kind == "cold":
                evict_all(*roots)
            mgr = CheckpointManager(cfg.checkpoint, b.layout, run_config=cfg.to_dict())
            s, info = timed(lambda: mgr.resume(b.objs))
            mgr.close()
            if info is None or info.tier is not expect:
                raise RuntimeError(f"resume loaded {info}, expected a {expect} checkpoint")
            out[kind].append(s)
            gc.collect()
            out.setdefault("mapped", []).append(max_over_ranks(float(mapped_bytes(roots))))
    return out


def mapped_bytes(roots: list[Path]) -> int:
    """Bytes of files under ``roots`` this process still maps (``/proc/self/maps``): after a resume
    nothing should be (a LOCAL load reads through a mapping that the loaded state must not keep;
    a kept one would also keep the "cold" resume warm)."""
    prefixes = [str(Path(r).resolve()) for r in roots]
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and any(parts[5].strip().startswith(p) for p in prefixes):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                total += hi - lo
    return total


# ----------------------------------------------------------------------------------------------- peers
PEERS = ("torch.save", "dcp.save", "dcp.async_save")


def peer_rep(b: Bench, name: str, d: Path) -> tuple[float, float, int]:
    """One save of the same tensors by peer ``name`` into ``d`` (then removed): its blocking and
    durable seconds (slowest rank) and the bytes it wrote (all ranks; 0 on other ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if getattr(b, "peer_pg", None) is None:
        b.peer_pg = dist.new_group(backend="gloo")  # DCP's async collectives stay off the training group
        b.dcp_sd = {f"rank{rank()}{k}": v for k, v in b.flat.items()}  # distinct keys: every rank writes its own

    def torch_save():
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"rank{rank()}.pt", "wb") as f:
            torch.save(b.flat, f)
            f.flush()
            os.fsync(f.fileno())
        return None

    fn = {"torch.save": torch_save,
          "dcp.save": lambda: dcp.save(b.dcp_sd, storage_writer=FileSystemWriter(str(d)), process_group=b.peer_pg),
          "dcp.async_save": lambda: dcp.async_save(b.dcp_sd, storage_writer=FileSystemWriter(str(d)),
                                                   process_group=b.peer_pg)}[name]
    dist.barrier()
    t0 = time.perf_counter()
    fut = fn()
    blocking = max_over_ranks(time.perf_counter() - t0)
    if fut is not None and hasattr(fut, "result"):
        fut.result()
    durable = max_over_ranks(time.perf_counter() - t0)
    dist.barrier()
    nbytes = bytes_under(d) if rank() == 0 else 0
    remove(d)
    return blocking, durable, nbytes


def measure_peers(b: Bench, reps: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for name in PEERS:
        res = out[name] = {"blocking": [], "durable": [], "bytes": []}
        for i in range(reps):
            for key, x in zip(("blocking", "durable", "bytes"), peer_rep(b, name, b.root / "peers" / f"{name}-{i}")):
                res[key].append(x)
    return out


# ----------------------------------------------------------------------------------------------- report
def stat(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fmt_row(name: str, xs: Optional[list[float]], nbytes: int, limit: Optional[float], peer: Optional[float],
            peer_name: str = "") -> str:
    if not xs:
        return f"{name:<34} {'n/a':>8}"
    med, lo, hi = stat(xs)
    cols = f"{name:<34} {med:8.3f} {lo:8.3f} {hi:8.3f} {nbytes / med / GB:8.2f}"
    cols += f" {limit:8.3f} {med / limit:7.2f}x" if limit else f" {'':8} {'':8}"
    cols += f" {peer:8.3f} {med / peer:7.2f}x {peer_name}" if peer else ""
    return cols


def report(b: Bench, args, lim, gs, ga, lo, lt, rg, rl, rt, peers, rss, guard) -> None:
    if rank() != 0:
        return
    total = b.total_state_bytes
    memcpy, write, read = (statistics.median(lim[k]) for k in ("memcpy", "write", "read_cold"))
    best_block = min(peers, key=lambda k: statistics.median(peers[k]["blocking"]))
    best_dur = min(peers, key=lambda k: statistics.median(peers[k]["durable"]))
    pb, pd = statistics.median(peers[best_block]["blocking"]), statistics.median(peers[best_dur]["durable"])
    m = b.cfg.model
    print(f"\n== checkpoint benchmark, scale={args.scale}: {m.num_layers} layers, hidden {m.hidden_size}, "
          f"TP={b.cfg.distributed.tensor_model_parallel_size}, {dist.get_world_size()} ranks, fp32 Adam; "
          f"{args.reps} reps (median, min, max)")
    print(f"state per rank (model + optimizer): {b.state_bytes / 2**30:.3f} GiB ({b.state_bytes:,} bytes); "
          f"all ranks {total / GB:.3f} GB. GB/s = all ranks' state bytes / time (slowest rank).")
    print(f"save directory: {b.root}\n")
    hdr = f"{'figure (seconds)':<34} {'median':>8} {'min':>8} {'max':>8} {'GB/s':>8} {'limit':>8} {'/limit':>8}"
    print(hdr + f" {'peer':>8} {'/peer':>8}")
    print("-" * (len(hdr) + 30))
    rows = [
        ("limit: copy_ into buffer", lim["memcpy"], None, None, ""),
        ("(clone into fresh memory)", lim["clone"], memcpy, None, ""),
        ("limit: write + fsync", lim["write"], None, None, ""),
        ("limit: cold read", lim["read_cold"], None, None, ""),
        ("non-finite guard: on the loop", guard["guard"], memcpy, None, ""),
        ("(guard: staged check, writer)", guard["staged"], memcpy, None, ""),
        ("(previous preflight, max+min)", guard["preflight"], memcpy, None, ""),
        ("GLOBAL sync: blocking (=durable)", gs["blocking"], write, pd, best_dur),
        ("GLOBAL async: blocking", ga["blocking"], memcpy, pb, best_block),
        ("GLOBAL async: to durable", ga["durable"], write, pd, best_dur),
        ("LOCAL: blocking", lo["blocking"], memcpy, pb, best_block),
        ("LOCAL: to durable", lo["durable"], write, pd, best_dur),
        ("LOCAL on tmpfs: blocking", lt["blocking"], memcpy, pb, best_block),
        ("LOCAL on tmpfs: to durable", lt["durable"], memcpy, pd, best_dur),
        ("resume GLOBAL: warm", rg["warm"], memcpy, None, ""),
        ("resume GLOBAL: cold", rg["cold"], read, None, ""),
        ("resume LOCAL: warm", rl["warm"], memcpy, None, ""),
        ("resume LOCAL: cold", rl["cold"], read, None, ""),
        ("resume LOCAL on tmpfs", rt["warm"], memcpy, None, ""),
    ]
    for name, res in peers.items():
        rows.append((f"peer {name}: blocking", res["blocking"], memcpy, None, ""))
        rows.append((f"peer {name}: durable", res["durable"], write, None, ""))
    for name, xs, limit, peer, pname in rows:
        print(fmt_row(name, xs, total, limit, peer, pname))
    print("\nnon-finite guard at one checkpoint boundary: on the loop, the interval's per-step flags (one "
          "all-reduce; per step the guard reads only the loss and megatron's gradient norm); on each tier's "
          "writer thread, before anything is written, a pass over every floating-point tensor of the staged "
          "state (off the loop; in the saves' blocking times above only through the CPU it shares); "
          "/limit = the ratio to the copy_ of the state; the previous preflight (max+min of every parameter "
          "and gradient) beside them.")
    print("limit column: copy_ for blocking times, warm resumes and tmpfs, write+fsync for durable times, cold "
          "read for cold resumes; peer column: the fastest peer on the same figure. tmpfs: "
          f"{b.tmpfs}. Durable: written, fsync'd and sealed on every rank (GLOBAL: published).")
    for name, res in (("GLOBAL async", ga), ("LOCAL", lo), ("LOCAL on tmpfs", lt)):
        per_step = [e / max(n, 1) / bs for e, n, bs in zip(res["extra"], res["steps"], res["base"])]
        dur = statistics.median(res["durable"])
        print(f"{name}: {statistics.median(res['steps']):.0f} steps overlapped the background write (median); "
              f"their extra time {statistics.median(res['extra']):+.3f} s in all (min {min(res['extra']):+.3f}, "
              f"max {max(res['extra']):+.3f}) = {statistics.median(res['extra']) / dur:.2f}x the save's durable "
              f"time (goal <= 0.25x); {100 * statistics.median(per_step):+.0f}% per step over a "
              f"{statistics.median(res['base']):.3f} s step without a save")
    print("staging buffers per rank (host memory kept between saves): "
          + ", ".join(f"{k} {v[2] / 2**30:.3f} GiB ({v[2] / b.state_bytes:.2f}x the state)" for k, v in rss.items()))
    print("resident memory growth from save 2 to save {n} (largest over ranks; bound: 0.05x the state = "
          "{bound:.0f} MiB): ".format(n=args.rss_saves, bound=0.05 * b.state_bytes / 2**20)
          + ", ".join(f"{k} {v[1] / 2**20:+.0f} MiB" for k, v in rss.items()))
    print("checkpoint bytes still mapped after a resume (largest over ranks and repetitions; must be 0, or "
          "the cold figures were warm): " + ", ".join(f"{k} {max(v['mapped']):.0f} B" for k, v in
                                                       (("GLOBAL", rg), ("LOCAL", rl), ("LOCAL on tmpfs", rt))))
    print(paired_report(gs, ga))
    wr = [("GLOBAL sync", statistics.median(gs["bytes"])), ("GLOBAL async", statistics.median(ga["bytes"])),
          ("LOCAL", statistics.median(lo["bytes"]))]
    wr += [(k, statistics.median(v["bytes"])) for k, v in peers.items()]
    print("bytes written per checkpoint / state bytes: "
          + ", ".join(f"{k} {v / total:.3f}" for k, v in wr))


def paired_report(gs: dict, ga: dict) -> str:
    """The GLOBAL figures against torch.distributed.checkpoint, repetition by repetition: each of
    our saves was followed at once by the peer's on the same tensors, so both see the same page
    cache and the same drift of the machine; the ratio is the median of the per-pair ratios."""
    pairs = [("GLOBAL sync (=durable) / dcp.save", gs["blocking"], gs["paired dcp.save"]),
             ("GLOBAL async blocking / dcp.async_save blocking", ga["blocking"], ga["paired dcp.async_save blocking"]),
             ("GLOBAL async to durable / dcp.async_save to durable", ga["durable"], ga["paired dcp.async_save durable"]),
             ("GLOBAL async to durable / dcp.save", ga["durable"], ga["paired dcp.save"])]
    lines = ["GLOBAL against torch.distributed.checkpoint, paired repetitions (ours and the peer at once, "
             "same tensors; sync pairs in alternating order): median of the per-pair ratios [each pair's ratio]; "
             "<= 1.00x: at least as fast"]
    for name, ours, peer in pairs:
        ratios = [o / p for o, p in zip(ours, peer)]
        lines.append(f"  {name:<54} {statistics.median(ratios):5.2f}x  "
                     f"[{', '.join(f'{r:.2f}' for r in ratios)}]  ours {statistics.median(ours):.3f} s, "
                     f"peer {statistics.median(peer):.3f} s")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
def profile_one(b: Bench, mgrs: dict, which: str, cfgs: dict) -> None:
    """cProfile on rank 0 of one save (and its wait) or resume: the training thread, and for a save
    also the writer thread's job (profiled in that thread). Other ranks run unprofiled."""
    from tierstack.checkpointing import CheckpointManager, CheckpointTier
    from tierstack.checkpointing.staging import Stager

    b.objs.train_state.step += 1
    prof, writer_prof = cProfile.Profile(), cProfile.Profile()
    real_submit = Stager.submit

    def submit(self, fn, *args, **kwargs):  # run the writer's job under its own profiler (rank 0)
        def job(*a, **k):
            writer_prof.enable()
            try:
                return fn(*a, **k)
            finally:
                writer_prof.disable()
        return real_submit(self, job if rank() == 0 else fn, *args, **kwargs)

    Stager.submit = submit
    if which in ("resume-global", "resume-local"):
        evict_all(b.root)
        mgr = CheckpointManager(cfgs[which].checkpoint, b.layout, run_config=cfgs[which].to_dict())
        fn = lambda: mgr.resume(b.objs)  # noqa: E731
    else:
        m = mgrs[which]
        tier = CheckpointTier.LOCAL if which == "local" else CheckpointTier.GLOBAL
        fn = lambda: (m.save(tier, b.objs), m.wait())  # noqa: E731
        fn()  # one unprofiled save first: the profile shows the steady state, not the buffers' first touch
        b.objs.train_state.step += 1
    dist.barrier()
    if rank() == 0:
        prof.enable()
    s, _ = timed(fn)
    Stager.submit = real_submit
    if rank() == 0:
        prof.disable()
        for name, p in (("training thread", prof), ("writer thread", writer_prof)):
            buf = io.StringIO()
            try:
                pstats.Stats(p, stream=buf).sort_stats("cumulative").print_stats(25)
            except TypeError:  # nothing recorded (no writer job)
                continue
            print(f"\n== cProfile of {which}, {name}, rank 0 ({s:.3f} s, slowest rank)\n" + buf.getvalue())


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=("default", "1gib"), default="default")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 5; 3 at 1gib)")
    ap.add_argument("--dir", default="runs/bench_checkpoint", help="save directory (wiped)")
    ap.add_argument("--max-async-steps", type=int, default=40, help="steps at most while an async save runs")
    ap.add_argument("--rss-saves", type=int, default=None,
                    help="saves per tier for the resident-memory check (default 20; 10 at 1gib)")
    ap.add_argument("--only", choices=("global",),
                    help="only the GLOBAL save figures, each paired with torch.distributed.checkpoint (quicker, "
                         "so more --reps fit)")
    ap.add_argument("--profile", choices=("global-sync", "global-async", "local", "resume-global", "resume-local"),
                    help="only profile this path once (cProfile, rank 0) instead of benchmarking")
    args = ap.parse_args()
    args.reps = args.reps or (3 if args.scale == "1gib" else 5)
    args.rss_saves = args.rss_saves or (10 if args.scale == "1gib" else 20)
    return args


def main() -> int:
    from tierstack.checkpointing import CheckpointManager, CheckpointTier

    args = parse_args()
    warnings.filterwarnings("ignore")  # megatron's CPU/Apex/deprecation notices, once per rank
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    t_start = time.perf_counter()
    root = Path(args.dir).resolve()
    cfg = bench_config(args.scale, root)
    b = build(cfg, root)
    remove(root)
    # One manager per tier set-up, each closed after its figures: closing frees its staging buffers
    # (one copy of the state each), so at most one set is held at a time.
    cfg_gsync = with_checkpoint(cfg, local_dir=None)
    cfg_async = with_checkpoint(cfg, save=str(root / "global_async"), local_dir=None, async_save=True)
    cfg_local = with_checkpoint(cfg, save=None)
    # LOCAL on a tmpfs: one directory per node (torchrun's pid is the same for its ranks)
    b.tmpfs = Path(f"/dev/shm/tierstack-bench-{os.getppid()}")
    cfg_tmpfs = with_checkpoint(cfg, save=None, local_dir=str(b.tmpfs))
    mgrs = {k: CheckpointManager(c.checkpoint, b.layout, run_config=c.to_dict())  # GLOBAL ones start the writer's result channel now
            for k, c in (("global-sync", cfg_gsync), ("global-async", cfg_async), ("local", cfg_local),
                         ("tmpfs", cfg_tmpfs))}
    for m in mgrs.values():
        m.resume(b.objs)  # fresh start: agrees on a run id, claims the roots
    b.step()  # Adam state exists after the first step
    b.flat = flatten_state(b.objs)
    b.state_bytes = sum(t.numel() * t.element_size() for t in b.flat.values())
    b.total_state_bytes = sum_over_ranks(b.state_bytes)
    cfgs = {
        "resume-global": with_checkpoint(cfg, save=None, load=cfg.checkpoint.save, local_dir=None),
        "resume-local": with_checkpoint(cfg, save=None, load=None),
        "resume-tmpfs": with_checkpoint(cfg_tmpfs, save=None, load=None),
    }
    if args.profile:
        if args.profile.startswith("resume"):
            mgrs["global-sync"].save(CheckpointTier.GLOBAL, b.objs)
            mgrs["local"].save(CheckpointTier.LOCAL, b.objs)
            mgrs["local"].wait()
        profile_one(b, mgrs, args.profile, cfgs)
    elif args.only == "global":
        gs = measure_global_sync(b, mgrs["global-sync"], args.reps)
        ga = measure_async(b, mgrs["global-async"], CheckpointTier.GLOBAL, args.reps, args.max_async_steps)
        if rank() == 0:
            print(f"\n== GLOBAL saves, scale={args.scale}, {args.reps} reps; state per rank "
                  f"{b.state_bytes / 2**30:.3f} GiB\n" + paired_report(gs, ga))
    else:
        G, L = CheckpointTier.GLOBAL, CheckpointTier.LOCAL
        lim = measure_limits(b, args.reps)
        guard = measure_guard(b, args.reps)
        gs = measure_global_sync(b, mgrs["global-sync"], args.reps)
        mgrs["global-sync"].close()
        ga = measure_async(b, mgrs["global-async"], G, args.reps, args.max_async_steps)
        rss = {"GLOBAL async": measure_rss(b, mgrs["global-async"], G, args.rss_saves)}
        mgrs["global-async"].close()
        lo = measure_async(b, mgrs["local"], L, args.reps, args.max_async_steps)
        rss["LOCAL"] = measure_rss(b, mgrs["local"], L, args.rss_saves)
        mgrs["local"].close()
        lt = measure_async(b, mgrs["tmpfs"], L, args.reps, args.max_async_steps)
        mgrs["tmpfs"].close()
        rt = measure_resume(b, cfgs["resume-tmpfs"], [b.tmpfs], args.reps, L)
        remove(b.tmpfs)  # give the memory back before the other figures
        peers = measure_peers(b, args.reps)
        rg = measure_resume(b, cfgs["resume-global"], [Path(cfg.checkpoint.save)], args.reps, G)
        rl = measure_resume(b, cfgs["resume-local"], [Path(cfg.checkpoint.local_dir)], args.reps, L)
        report(b, args, lim, gs, ga, lo, lt, rg, rl, rt, peers, rss, guard)
    for m in mgrs.values():
        m.close()
    remove(b.tmpfs)
    if rank() == 0:
        print(f"\nwall time of the whole benchmark: {time.perf_counter() - t_start:.0f} s")
    remove(root)
    from tierstack import runtime

    runtime.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
