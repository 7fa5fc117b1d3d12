"""Installing tierstack into an environment that already has the stack (as an NGC container has
torch, megatron-core and nvidia-resiliency-ext) changes none of it: pip's own dry run, with its
JSON report, on this venv (which holds exactly constraints.txt)."""

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
STACK = ("torch", "megatron-core", "nvidia-resiliency-ext", "transformers", "numpy")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)$", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_this_environment_is_the_locked_stack():
    """What the suite runs on is what constraints.txt says (so the next test means what it says)."""
    pins = _pins()
    assert sys.version_info[:2] == (3, 12)
    for name in STACK:
        assert metadata.version(name) == pins[name], name


def test_pip_install_dot_keeps_the_installed_stack(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--disable-pip-version-check",
         "--quiet", "--report", str(report), str(REPO)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    would_install = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                     for item in json.loads(report.read_text())["install"]}
    assert set(would_install) == {"tierstack"}, would_install  # nothing of the stack is up- or downgraded
