"""The chaos soak, short: ``scripts/bench_goodput.py --chaos 1.5 --seed 1`` on 2 simulated nodes.

A seeded stream of six faults of six kinds (a damaged LOCAL file, a transient EIO on a GLOBAL
write, a slow LOCAL write, a rank SIGKILL, ENOSPC on one GLOBAL save, a node replacement; the hang
is left out of soaks this short, see scripts/chaos.py) hits one training run with no human action.
Every fault is handled, ``tierstack checkpoints verify`` passes on every tier, the final losses
equal the failure-free run's bit for bit and no published GLOBAL checkpoint is lost.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launcher import REPO, run_group


@pytest.mark.slow
def test_a_short_chaos_soak_handles_every_fault_and_matches_the_failure_free_run(tmp_path):
    proc = run_group([sys.executable, str(REPO / "scripts" / "bench_goodput.py"), "--chaos", "1.5", "--seed", "1",
                      "--work-dir", str(tmp_path / "work"), "--local-root", str(tmp_path / "node_local")],
                     timeout=900, cwd=REPO)
    out = proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "work" / "chaos_summary.json").read_text())
    kinds = {f["kind"] for f in summary["faults"]}
    assert kinds == {"damage", "eio", "slow", "kill", "enospc", "node"}, out[-4000:]
    for f in summary["faults"]:
        assert f["ok"], (f, out[-4000:])
    for name, (ok, text) in summary["checks"].items():
        assert ok, (name, text, out[-4000:])
    assert any(name.startswith("verify ") and name.endswith("global") for name in summary["checks"])
    assert sum(name.startswith("verify ") and "/local" in name for name in summary["checks"]) == 2  # both nodes
    assert "all" in summary["checks"]["losses"][1] and "bit for bit" in summary["checks"]["losses"][1]
    damage = next(f for f in summary["faults"] if f["kind"] == "damage")
    assert "fetched from the peer's replica" in damage["handled"], damage  # not an older step
    assert proc.returncode == 0 and summary["ok"], out[-4000:]
    assert "totals:" in out and "goodput" in out
