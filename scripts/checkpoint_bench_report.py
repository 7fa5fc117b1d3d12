"""The checkpoint benchmark's report (``scripts/bench_checkpoint.py``): the table of figures with their
limits and peers, the GLOBAL figures paired with torch.distributed.checkpoint, and the cProfile of one
save or resume."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
from typing import Optional

import torch.distributed as dist

from checkpoint_bench_state import GB, Bench, evict_all, rank, timed


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
    """The GLOBAL figures against torch.distributed.checkpoint, in counterbalanced blocks.

    Each of our saves ran next to the peer's on the same tensors, ours first in even repetitions and
    the peer first in odd ones, so two repetitions make an ABBA block. The ratio of a block is the
    sum of our two times over the sum of the peer's two, and the figure is the median over blocks.
    Why blocks and not pairs: on a disk whose speed alternates from one large write to the next
    (this machine's did: every other save about twice as slow, whoever made it), the ratio of a
    single pair measures the order of the pair; within an ABBA block both sides get one save in
    each position. An odd last repetition is left out of the blocks.
    """
    pairs = [("GLOBAL sync (=durable) / dcp.save", gs["blocking"], gs["paired dcp.save"]),
             ("GLOBAL async blocking / dcp.async_save blocking", ga["blocking"], ga["paired dcp.async_save blocking"]),
             ("GLOBAL async to durable / dcp.async_save to durable", ga["durable"], ga["paired dcp.async_save durable"]),
             ("GLOBAL async to durable / dcp.save", ga["durable"], ga["paired dcp.save"])]
    lines = ["GLOBAL against torch.distributed.checkpoint, ABBA blocks of two repetitions (ours and the peer on the "
             "same tensors, the order reversed every other repetition): median over blocks of sum(ours) / sum(peer) "
             "[each block's ratio]; <= 1.00x: at least as fast"]
    for name, ours, peer in pairs:
        n = min(len(ours), len(peer)) // 2 * 2
        blocks = [(ours[k] + ours[k + 1]) / (peer[k] + peer[k + 1]) for k in range(0, n, 2)]
        ratio = f"{statistics.median(blocks):5.2f}x" if blocks else "  n/a"
        lines.append(f"  {name:<54} {ratio}  [{', '.join(f'{r:.2f}' for r in blocks)}]  "
                     f"ours {statistics.median(ours):.3f} s, peer {statistics.median(peer):.3f} s; "
                     f"each rep ours/peer: {', '.join(f'{o:.2f}/{p:.2f}' for o, p in zip(ours, peer))}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- profile
def profile_one(b: Bench, mgrs: dict, which: str, cfgs: dict) -> None:
    """cProfile on rank 0 of one save (and its wait) or resume. Other ranks run unprofiled.

    On Python 3.12 cProfile is built on ``sys.monitoring`` (PEP 669): one profiler sees every
    thread of the process, the writer thread's job included, and a second one cannot be enabled
    beside it (``ValueError: Another profiling tool is already active``), so there is one table.
    """
    from tierstack.checkpointing import CheckpointManager, CheckpointTier

    b.objs.train_state.step += 1
    prof = cProfile.Profile()
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
    if rank() == 0:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        print(f"\n== cProfile of {which}, every thread, rank 0 ({s:.3f} s, slowest rank)\n" + buf.getvalue())
