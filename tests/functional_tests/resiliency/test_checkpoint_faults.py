"""Fault injection into real 2-rank saves: every failure reaches every rank, nothing hangs, nothing
published is lost, transient errors are retried, permanent ones are not and say what failed.

Each launch runs ``checkpointing/ckpt_worker.py`` (tierstack.pretrain, tiny GPT, a save at every
step) with several faults at different steps (see ``faults.py``), then a second launch checks
what it resumes from. Every case is timed and must end well inside ``distributed.timeout_s``; the
test also checks that torchrun, the ranks and every process they started have exited.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

import faults
from launcher import run_torchrun
from tierstack.checkpointing import listing

HERE = Path(__file__).parent
WORKER = HERE.parent / "checkpointing" / "ckpt_worker.py"
LAUNCH_TIMEOUT_S = 300  # the test's own bound; every case must end far sooner
DIST_TIMEOUT_S = 600  # distributed.timeout_s of the runs (the default): what a hang would cost
COLLECTIVE_TIMEOUT_S = 20
TORCHRUN_GRACE_S = 30  # torchrun's wait between SIGTERM and SIGKILL of the remaining ranks
BASE = ["checkpoint.retry_backoff_s=0.05", f"checkpoint.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        f"distributed.timeout_s={DIST_TIMEOUT_S}", "checkpoint.most_recent_k=-1",
        "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
TABLE: list[dict] = []


def launch(out: Path, fault_list: list[dict], *overrides: str) -> dict:
    """Run 2 ranks (the suite's launcher) with ``fault_list`` injected; on timeout kill every process.

    Returns ``{"rc", "log", "wall_s", "records", "fired"}``; asserts no process is left behind.
    """
    fault_dir = out / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {"TIERSTACK_FAULTS": json.dumps(fault_list), "TIERSTACK_FAULT_DIR": str(fault_dir),
           "PYTHONPATH": os.pathsep.join([str(HERE / "inject"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    try:
        proc = run_torchrun([WORKER, out / "rec", f"logger.run_dir={out}/run", *BASE, *overrides],
                            timeout=LAUNCH_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:
        _kill_launch(fault_dir)  # the ranks run in sessions of their own: found by their environment
        pytest.fail(f"hang: no exit within {LAUNCH_TIMEOUT_S}s\n{(e.output or '')[-3000:]}{(e.stderr or '')[-3000:]}")
    wall = time.monotonic() - t0
    ended = time.time()
    log = proc.stdout + proc.stderr
    (out / "launch.log").write_text(log)
    _assert_nothing_left(fault_dir)
    records = []
    for r in range(2):
        f = out / "rec" / f"rank{r}.json"
        records.append(json.loads(f.read_text()) if f.exists() else None)
    return {"rc": proc.returncode, "log": log, "wall_s": wall, "records": records, "ended": ended,
            "fired": faults.fired(fault_dir), "fault_dir": fault_dir}


def seconds_to_exit(run: dict, fid: str) -> float:
    """From the first firing of ``fid`` to torchrun's exit."""
    return run["ended"] - faults.first_fired_at(run["fault_dir"], fid)


def _launch_processes(fault_dir: Path) -> list:
    """Every live process started under one launch: torchrun puts each rank in its own session, and
    the children of a killed rank are re-parented, so they are found by the environment they inherit."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("TIERSTACK_FAULT_DIR") == str(fault_dir) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _kill_launch(fault_dir: Path) -> None:
    for p in _launch_processes(fault_dir):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _assert_nothing_left(fault_dir: Path) -> None:
    deadline = time.monotonic() + 10  # the launcher reaps what is left of a dead rank within seconds
    while (left := _launch_processes(fault_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    info = [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
    _kill_launch(fault_dir)
    assert not info, f"processes left behind: {info}"


def fault(fid, op, path, rank, err, times=1, **kw) -> dict:
    return {"id": fid, "op": op, "path": path, "rank": rank, "errno": err, "times": times, **kw}


def published_global(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_") and p.name[5:].isdigit())


def record(tier, phase, fid, rank, err, attempts, outcome, resumed, wall):
    TABLE.append(dict(fault=err, rank=rank, tier=tier, phase=phase, id=fid, attempts=attempts,
                      outcome=outcome, resumed=resumed, wall_s=round(wall, 1)))


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if TABLE:
        cols = ["fault", "rank", "tier", "phase", "attempts", "outcome", "resumed", "wall_s", "id"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in TABLE]
        text = "\n".join(lines)
        print("\n" + text)
        out = os.environ.get("TIERSTACK_FAULT_TABLE")
        if out:
            Path(out).write_text(text + "\n")


def _global_faults(g: str, asynchronous: bool) -> tuple[list[dict], dict]:
    """Faults of one GLOBAL launch, one step each; returns them and the expected outcome per step."""
    st = lambda n: f"{g}/iter_{n:07d}.staging-*"  # noqa: E731
    fl = [
        fault("write-r1-EIO", "write", st(2) + "/__1_*", 1, "EIO"),
        fault("metadata-r0-EAGAIN", "write", st(3) + "/.metadata*", 0, "EAGAIN"),
        fault("config-r0-ESTALE", "write", st(4) + "/metadata.json", 0, "ESTALE"),
        fault("seal-manifest-r0-EIO", "write", st(5) + "/.manifest.json.tmp-*", 0, "EIO"),
        fault("seal-read-r1-EAGAIN", "read", st(6) + "/__1_*", 1, "EAGAIN"),
        fault("publish-rename-r0-ESTALE", "rename", f"{g}/iter_0000007", 0, "ESTALE"),
        # async: the tracker of step 7 may be written while step 8's staging exists; hit the rename
        fault("publish-rename-r0-ENOSPC", "rename", f"{g}/iter_0000008", 0, "ENOSPC", -1) if asynchronous else
        fault("publish-tracker-r0-ENOSPC", "write", f"{g}/.latest_train_state.pt.tmp-*", 0, "ENOSPC", -1,
              if_exists=st(8)),
        fault("write-r1-EACCES", "write", st(9) + "/__1_*", 1, "EACCES", -1),
        fault("metadata-r0-EROFS", "write", st(10) + "/.metadata*", 0, "EROFS", -1),
    ]
    phases = {"write-r1-EIO": "write", "metadata-r0-EAGAIN": "agree (rank-0 .metadata)",
              "config-r0-ESTALE": "agree (rank-0 metadata.json)", "seal-manifest-r0-EIO": "seal",
              "seal-read-r1-EAGAIN": "write (checksum, writer thread)", "publish-rename-r0-ESTALE": "publish",
              "publish-tracker-r0-ENOSPC": "publish (tracker)", "publish-rename-r0-ENOSPC": "publish", "write-r1-EACCES": "write",
              "metadata-r0-EROFS": "agree (rank-0 .metadata)"}
    return fl, phases


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_global_save_faults(mode, tmp_path):
    """GLOBAL tier: transient faults at steps 2-7 end published after a retry, permanent ones at 8-10
    are not retried and name path and errno; the next launch resumes from 7."""
    g = tmp_path / "global"
    fl, phases = _global_faults(str(g), mode == "async")
    run = launch(tmp_path / "a", fl, "train.train_iters=10", f"checkpoint.save={g}", "checkpoint.save_interval=1",
                 f"checkpoint.async_save={str(mode == 'async').lower()}")
    log = run["log"]
    assert run["rc"] == 0, log[-6000:]
    assert run["wall_s"] < DIST_TIMEOUT_S / 4
    fired = {fid for fid, _, _ in run["fired"]}
    assert fired == {f["id"] for f in fl}, ({f["id"] for f in fl} - fired, log[-4000:])
    # transient: published after a retry; permanent: never published, named with path and errno
    assert published_global(g) == [1, 2, 3, 4, 5, 6, 7], log[-6000:]
    assert (g / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    assert torch.load(g / "latest_train_state.pt")["step"] == 7
    assert run["records"][0]["published"] == [1, 2, 3, 4, 5, 6, 7] == run["records"][1]["published"]
    for step, err, path in ((8, "ENOSPC", "iter_0000008" if mode == "async" else ".latest_train_state.pt.tmp"),
                            (9, "EACCES", "iter_0000009.staging"),
                            (10, "EROFS", "iter_0000010.staging")):
        lines = [ln for ln in log.splitlines() if f"checkpoint of step {step} NOT" in ln]
        assert len(lines) == 2, (step, log[-6000:])  # on every rank
        assert all(err in ln and path in ln and "permanent" in ln for ln in lines), (step, lines)
    assert "not retried" in log
    assert not [p for p in g.iterdir() if ".invalid-" in p.name]  # no superseded copies of a retried step
    text, status = listing.verify(str(g))
    assert status == 0, text
    # the next launch resumes from the newest published step, 7, on both ranks
    nxt = launch(tmp_path / "b", [], "train.train_iters=8", f"checkpoint.save={g}")
    assert nxt["rc"] == 0, nxt["log"][-4000:]
    assert [(r["resume"]["tier"], r["resume"]["step"]) for r in nxt["records"]] == [("global", 7)] * 2
    for f in fl:
        transient = f["times"] == 1
        step = next(n for n in range(1, 11) if f"iter_{n:07d}" in f["path"] + f.get("if_exists", ""))
        if transient:  # the log shows the failed attempt, with path and errno, and the retry
            assert any("retrying" in ln and f"iter_{step:07d}" in ln and f["errno"] in ln for ln in log.splitlines()), f
        record(f"global {mode}", phases[f["id"]], f["id"], f["rank"], f["errno"], _attempts(run["fired"], f),
               "published after retry" if transient else "not published, not retried", 7, run["wall_s"])


def _attempts(fired: list, f: dict) -> int:
    """Attempts of the save a fault hit: failed ones (distinct staging attempts, else firings), plus
    the successful retry of a transient fault."""
    hits = [path for fid, _, path in fired if fid == f["id"]]
    attempts = {p.split(".staging-")[1].split("/")[0] for p in hits if ".staging-" in p}
    failed = len(attempts) if len(attempts) > 1 else min(len(hits), 1)
    return failed + (1 if f["times"] == 1 else 0)


@pytest.mark.slow
def test_local_save_faults(tmp_path):
    """LOCAL tier (asynchronous, tierstack's writer thread): transient faults at steps 2-5 end saved
    after a retry inside the writer on the rank that hit them;
    permanent ones at 6-8 are not retried; the next launch resumes from LOCAL step 5."""
    loc = tmp_path / "local"
    f = lambda n, r: f"{loc}/{r}/iter_{n:07d}_{r}_local"  # noqa: E731
    fl = [
        fault("l-write-r1-EIO", "write", f(2, 1) + ".dirty.pt", 1, "EIO"),
        fault("l-write-r0-ESTALE", "write", f(3, 0) + ".dirty.pt", 0, "ESTALE"),
        fault("l-seal-r1-EAGAIN", "write", f"{loc}/1/.iter_0000004_1_local.manifest.json.tmp-*", 1, "EAGAIN"),
        fault("l-publish-r0-EIO", "rename", f(5, 0) + ".dirty.pt", 0, "EIO"),
        fault("l-write-r0-EACCES", "write", f(6, 0) + ".dirty.pt", 0, "EACCES", -1),
        fault("l-seal-r1-EROFS", "write", f"{loc}/1/.iter_0000007_1_local.manifest.json.tmp-*", 1, "EROFS", -1),
        fault("l-publish-r1-ENOSPC", "rename", f(8, 1) + ".dirty.pt", 1, "ENOSPC", -1),
    ]
    phases = {"write": "write", "seal": "seal", "publish": "publish"}
    run = launch(tmp_path / "a", fl, "train.train_iters=8", f"checkpoint.local_dir={loc}",
                 "checkpoint.local_save_interval=1")
    log = run["log"]
    assert run["rc"] == 0, log[-6000:]
    assert {fid for fid, _, _ in run["fired"]} == {x["id"] for x in fl}, log[-4000:]
    for r in (0, 1):
        saved = sorted(int(p.name[5:12]) for p in (loc / str(r)).iterdir() if p.name.endswith("_local.pt"))
        assert saved == [1, 2, 3, 4, 5], (r, saved, log[-4000:])
        assert not [p for p in (loc / str(r)).iterdir() if ".dirty" in p.name or ".tmp-" in p.name]
    for step, err in ((6, "EACCES"), (7, "EROFS"), (8, "ENOSPC")):
        lines = [ln for ln in log.splitlines() if f"LOCAL checkpoint of step {step} NOT saved" in ln]
        assert len(lines) == 2 and all(err in ln and f"iter_{step:07d}" in ln for ln in lines), (step, log[-4000:])
    assert listing.verify(str(loc))[1] == 0
    # next launch keeps 2: rank 1 cannot remove its step-1 file (EACCES); nothing newer is lost
    ret = [fault("l-retention-r1-EACCES", "remove", f(1, 1) + ".pt", 1, "EACCES", -1)]
    nxt = launch(tmp_path / "b", ret, "train.train_iters=6", f"checkpoint.local_dir={loc}", "checkpoint.most_recent_k=2")
    assert nxt["rc"] == 0, nxt["log"][-4000:]
    assert [(r["resume"]["tier"], r["resume"]["step"]) for r in nxt["records"]] == [("local", 5)] * 2
    assert "retention: could not remove" in nxt["log"]
    kept = {r: sorted(int(p.name[5:12]) for p in (loc / str(r)).iterdir() if p.name.endswith("_local.pt")) for r in (0, 1)}
    assert kept == {0: [5, 6], 1: [1, 5, 6]}, kept
    record("local", "retention", "l-retention-r1-EACCES", 1, "EACCES", 1, "step 6 saved; old file kept", 5, nxt["wall_s"])
    for x in fl:
        transient = x["times"] == 1
        if transient:
            step = int(x["path"].split("iter_")[1][:7])
            assert any("retrying" in ln and f"iter_{step:07d}" in ln and x["errno"] in ln for ln in log.splitlines()), x
        record("local", phases[x["id"].split("-")[1]], x["id"], x["rank"], x["errno"], _attempts(run["fired"], x),
               "saved after retry" if transient else "not saved, not retried", 5, run["wall_s"])


@pytest.mark.slow
def test_sigkill_of_one_rank_during_global_write(tmp_path):
    """Rank 1 is SIGKILLed while writing GLOBAL step 3; torchrun then sends SIGTERM to rank 0, whose
    planned-exit save needs the dead rank: every process must be gone within the collective
    timeout, not distributed.timeout_s. Steps 1-2 stay published, the interrupted save is a
    leftover (verify exits 0), and the next launch resumes from 2 and removes the leftover."""
    g = tmp_path / "global"
    fl = [fault("kill-r1-write", "kill", f"{g}/iter_0000003.staging-*/__1_*", 1, "EIO")]
    run = launch(tmp_path / "a", fl, "train.train_iters=6", f"checkpoint.save={g}", "checkpoint.save_interval=1")
    assert run["rc"] != 0
    assert seconds_to_exit(run, "kill-r1-write") < COLLECTIVE_TIMEOUT_S + TORCHRUN_GRACE_S, run["log"][-4000:]
    assert published_global(g) == [1, 2], run["log"][-4000:]
    text, status = listing.verify(str(g))
    assert status == 0 and "leftover" in text, text
    # the next launch also keeps 2 checkpoints: retention of step 1 (on rank 0's retention thread)
    # renames it out of the candidates, then deleting it fails once (EIO) after step 3's publish,
    # which stays published; a later save (4 or 5, once that thread is idle) removes what is left
    # of 1; the publishes of 4 and 5 remove 2 and 3
    ret = [fault("retention-r0-EIO", "remove", f"{g}/iter_0000001.deleting-*", 0, "EIO")]
    nxt = launch(tmp_path / "b", ret, "train.train_iters=5", f"checkpoint.save={g}", "checkpoint.save_interval=1",
                 "checkpoint.most_recent_k=2")
    assert nxt["rc"] == 0, nxt["log"][-4000:]
    assert [(r["resume"]["tier"], r["resume"]["step"]) for r in nxt["records"]] == [("global", 2)] * 2
    assert not [p for p in g.iterdir() if ".staging-" in p.name]  # cleaned by the next save
    assert [f for f, _, _ in nxt["fired"]] == ["retention-r0-EIO"]
    assert "retention: could not remove" in nxt["log"] and nxt["records"][0]["published"] == [3, 4, 5]
    assert published_global(g) == [4, 5]
    assert not [p.name for p in g.iterdir() if ".deleting-" in p.name or p.name == "iter_0000001"]
    record("global sync", "write", "kill-r1-write", 1, "SIGKILL", 1,
           f"all exited {seconds_to_exit(run, 'kill-r1-write'):.0f}s after the kill", 2, run["wall_s"])
    record("global sync", "retention", "retention-r0-EIO", 0, "EIO", 2, "step kept published; its remains removed by the next save",
           2, nxt["wall_s"])


@pytest.mark.slow
def test_startup_failures_exit_without_hanging(tmp_path):
    """A bad checkpoint path is a config error naming the field, before any rank works; a
    CheckpointLoadError in setup (ckpt_step naming no checkpoint) ends every process, none hangs."""
    bad = launch(tmp_path / "a", [], "train.train_iters=2", "checkpoint.local_dir=/proc/nonexistent/sub/local")
    assert bad["rc"] != 0 and "checkpoint.local_dir=/proc/nonexistent/sub/local" in bad["log"], bad["log"][-3000:]
    assert "FileNotFoundError" not in bad["log"]
    g = tmp_path / "global"
    missing = launch(tmp_path / "b", [], "train.train_iters=2", f"checkpoint.save={g}", "checkpoint.ckpt_step=7")
    assert missing["rc"] != 0 and "checkpoint.ckpt_step=7" in missing["log"], missing["log"][-3000:]
    for name, run in (("bad local_dir", bad), ("ckpt_step", missing)):
        assert run["wall_s"] < DIST_TIMEOUT_S / 4
        record("-", "setup", name, "all", "config/load error", 0, "exited, nothing left", "-", run["wall_s"])


@pytest.mark.slow
def test_hung_rank_during_global_save_is_bounded_by_the_collective_timeout(tmp_path):
    """Rank 1 hangs (SIGSTOP) while writing GLOBAL step 2; rank 0 waits in megatron's write-results
    gather. With checkpoint.collective_timeout_s the wait ends after that bound, not after
    distributed.timeout_s, and rank 0 stops with an error saying a rank is gone or hung."""
    g = tmp_path / "global"
    fl = [fault("stop-r1-write", "stop", f"{g}/iter_0000002.staging-*/__1_*", 1, "EIO")]
    run = launch(tmp_path / "a", fl, "train.train_iters=4", f"checkpoint.save={g}", "checkpoint.save_interval=1")
    assert run["rc"] != 0
    assert "a rank is gone or hung" in run["log"], run["log"][-4000:]
    # rank 0: the collective timeout, then closing; rank 1 (stopped): torchrun's SIGTERM grace, then SIGKILL
    assert seconds_to_exit(run, "stop-r1-write") < COLLECTIVE_TIMEOUT_S + TORCHRUN_GRACE_S + 60, run["log"][-4000:]
    assert published_global(g) == [1]
    record("global sync", "write", "stop-r1-write", 1, "SIGSTOP (hang)", 1,
           f"rank 0 error after collective_timeout_s={COLLECTIVE_TIMEOUT_S}; all exited "
           f"{seconds_to_exit(run, 'stop-r1-write'):.0f}s after the hang", 1, run["wall_s"])
