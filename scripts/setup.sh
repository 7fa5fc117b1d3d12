#!/usr/bin/env bash
# Create the project-local virtualenv (.venv) when missing and install tierstack into it from the
# tested constraints set. Re-running is cheap: nothing is reinstalled unless constraints.txt or
# pyproject.toml changed. torch==2.13.0 is pinned so pip takes the CPU wheel already on the machine
# instead of a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "tierstack needs Python 3.11 (megatron-core 0.16 / nvidia-resiliency-ext 0.4.1); found $("$PY" --version)" >&2
  exit 1
fi
venv="$root/.venv"
stamp="$venv/.tierstack-installed"
want="$(cat constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch first, alone and pinned: a dependency asking for plain `torch` must find it satisfied.
"$venv/bin/python" -m pip install --quiet -c constraints.txt "torch==2.13.0"
"$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[test]"
echo "$want" > "$stamp"
echo "tierstack installed in $venv"
