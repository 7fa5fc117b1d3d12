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
import gc
import logging
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint_bench_report import paired_report, profile_one, report
from checkpoint_bench_state import (CHUNK_BYTES, Bench, bench_config, build, bytes_under, evict, evict_all,
                                    files_under, flatten_state, max_over_ranks, rank, remove, settle, sum_over_ranks,
                                    timed,
                                    with_checkpoint)


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
            for off in range(0, n, CHUNK_BYTES):
                f.write(src_view[off:off + CHUNK_BYTES])
            os.fsync(f.fileno())

    def read():
        with open(path, "rb", buffering=0) as f:
            for off in range(0, n, CHUNK_BYTES):
                f.readinto(dst_view[off:off + CHUNK_BYTES])

    out: dict[str, list[float]] = {"memcpy": [], "clone": [], "write": [], "read_cold": []}
    for _ in range(reps):
        out["memcpy"].append(timed(lambda: dst.copy_(src))[0])
        # Not a limit: what a snapshot into freshly allocated memory pays (first-touch page faults).
        out["clone"].append(timed(lambda: src.clone())[0])
        settle()
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
        # the peer at once, on the same state and page cache, the order reversed every other
        # repetition: two repetitions make one ABBA block of paired_report
        if i % 2:
            out["paired dcp.save"].append(peer_rep(b, "dcp.save", b.root / "paired")[1])
        b.objs.train_state.step += 1
        settle()
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
    for i in range(reps):
        # GLOBAL: its peers at once, on the same state and page cache, in reversed order on odd
        # repetitions (ours, dcp.async_save, dcp.save / dcp.save, dcp.async_save, ours): see paired_report
        peers_first = tier is CheckpointTier.GLOBAL and i % 2 == 1
        if peers_first:
            _paired_async_peers(b, out, reverse=True)
        b.objs.train_state.step += 1
        settle()
        t0 = time.perf_counter()
        mgr.save(tier, b.objs)
        blocking = max_over_ranks(time.perf_counter() - t0)
        mgr.wait()  # also waits for the retention this save started (not part of "durable")
        out["durable"].append(max_over_ranks(mgr.last_durable_s(tier)))
        out["blocking"].append(blocking)
        out["bytes"].append(saved_bytes(b, mgr, tier))
        if tier is CheckpointTier.GLOBAL and not peers_first:
            _paired_async_peers(b, out, reverse=False)
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


def _paired_async_peers(b: Bench, out: dict, *, reverse: bool) -> None:
    """dcp.async_save then dcp.save on the same tensors (dcp.save first when ``reverse``), into ``out``."""
    for name in (("dcp.save", "dcp.async_save") if reverse else ("dcp.async_save", "dcp.save")):
        blocking, durable, _ = peer_rep(b, name, b.root / "paired")
        if name == "dcp.save":
            out.setdefault("paired dcp.save", []).append(durable)
        else:
            out.setdefault("paired dcp.async_save blocking", []).append(blocking)
            out.setdefault("paired dcp.async_save durable", []).append(durable)


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
    settle()
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


# ------------------------------------------------------------------------------------------------- main

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
