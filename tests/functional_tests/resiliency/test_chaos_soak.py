"""The chaos soak, short: ``scripts/bench_goodput.py --chaos 1.5 --seed 1`` on 2 simulated nodes,
under in-process restart (the soak's default: 2 warm spares per node, a memory step every
iteration in node memory).

A seeded stream of seven faults of seven kinds (a damaged LOCAL file and memory step, a slow LOCAL
write, ENOSPC on one GLOBAL save, a hung rank, a rank SIGKILL, a transient EIO on a GLOBAL write, a
node replacement) hits one training run with no human action. Every fault is handled; every fault
of a process is handled in-process (a spare of the rank's node takes it, the other rank keeps its
process); ``tierstack checkpoints verify`` passes on every tier, the final losses equal the
failure-free run's bit for bit, no published GLOBAL checkpoint is lost, and nothing is left in node
memory.
"""

from __future__ import annotations

import json
import sys

import pytest

from launcher import REPO, run_group


@pytest.mark.slow
def test_a_short_chaos_soak_handles_every_fault_and_matches_the_failure_free_run(tmp_path):
    proc = run_group([sys.executable, str(REPO / "scripts" / "bench_goodput.py"), "--chaos", "1.5", "--seed", "1",
                      "--work-dir", str(tmp_path / "work"), "--local-root", str(tmp_path / "node_local")],
                     timeout=900, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "work" / "chaos_summary.json").is_file(), (proc.returncode, out[-6000:])
    summary = json.loads((tmp_path / "work" / "chaos_summary.json").read_text())
    kinds = {f["kind"] for f in summary["faults"]}
    assert kinds == {"damage", "eio", "slow", "kill", "enospc", "node", "hang"}, out[-4000:]
    for f in summary["faults"]:
        assert f["ok"], (f, out[-4000:])
        if f["kind"] in ("damage", "kill", "node", "hang"):  # 2 per rank for this seed: spares cover them
            assert "in-process: a spare" in f["handled"] and "kept its process" in f["handled"], (f, out[-4000:])
    hang = next(f for f in summary["faults"] if f["kind"] == "hang")
    assert "NVRx's SOFT_TIMEOUT" in hang["handled"] or "NVRx's HARD_TIMEOUT" in hang["handled"], hang
    assert "node memory" in summary["checks"]
    for name, (ok, text) in summary["checks"].items():
        assert ok, (name, text, out[-4000:])
    assert any(name.startswith("verify ") and name.endswith("global") for name in summary["checks"])
    assert sum(name.startswith("verify ") and "/local" in name for name in summary["checks"]) == 2  # both nodes
    assert "all" in summary["checks"]["losses"][1] and "bit for bit" in summary["checks"]["losses"][1]
    damage = next(f for f in summary["faults"] if f["kind"] == "damage")
    assert "fetched from the peer's replica" in damage["handled"] or "was not needed" in damage["handled"], damage
    assert proc.returncode == 0 and summary["ok"], out[-4000:]
    assert "totals:" in out and "goodput" in out
