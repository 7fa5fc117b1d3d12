"""The checkpoint benchmark keeps running: a refactor that breaks ``scripts/bench_checkpoint.py``
(as one did, at its first LOCAL figure) fails here instead of on the next person who measures.

At the default (small) scale with one repetition: it checks that every figure of the table is
measured and printed, not how fast anything is (timing goals live in the benchmark's own output).
"""

import re

import pytest

from launcher import REPO, run_torchrun

FIGURES = (
    "limit: copy_ into buffer", "limit: write + fsync", "limit: cold read",
    "GLOBAL sync: blocking (=durable)", "GLOBAL async: blocking", "GLOBAL async: to durable",
    "LOCAL: blocking", "LOCAL: to durable", "LOCAL on tmpfs: blocking", "LOCAL on tmpfs: to durable",
    "resume GLOBAL: warm", "resume GLOBAL: cold", "resume LOCAL: warm", "resume LOCAL: cold",
    "resume LOCAL on tmpfs", "peer dcp.save: durable", "non-finite guard: on the loop", "(guard: staged check, writer)",
)


@pytest.mark.slow
def test_bench_checkpoint_prints_every_figure(tmp_path):
    proc = run_torchrun([REPO / "scripts" / "bench_checkpoint.py", "--reps", "1", "--rss-saves", "3",
                         "--dir", tmp_path / "bench"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = proc.stdout
    for name in FIGURES:
        row = re.search(rf"^{re.escape(name)}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)", out, re.M)
        assert row, f"figure {name!r} missing from the table:\n{out}"
        assert 0 < float(row.group(1)) < 600
    assert re.search(r"^bytes written per checkpoint / state bytes: GLOBAL sync \d", out, re.M), out
    assert re.search(r"^staging buffers per rank .*LOCAL \d", out, re.M), out
    assert not (tmp_path / "bench").exists(), "the benchmark removes its save directory"
