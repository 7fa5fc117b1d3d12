#!/usr/bin/env bash
# Create the project-local virtualenv (.venv) when missing and install tierstack into it from the
# tested set in constraints.txt (Python 3.12, megatron-core 0.19, nvidia-resiliency-ext 0.7).
# Re-running is cheap: nothing is reinstalled unless constraints.txt, pyproject.toml or this script
# changed. pip's cache (~/.cache/pip) is used where it exists, so a second venv downloads nothing.
#
# Python: $PYTHON if set, else python3.12 on PATH, else a 3.12 interpreter of pyenv.
#
# nvidia-resiliency-ext (NVRx) >= 0.5 publishes only manylinux_2_39 wheels (glibc >= 2.39, as in
# current GPU containers) and no source distribution. On an older glibc pip refuses them, so this
# script installs that one wheel with pip's own cross-platform options (--platform, --only-binary,
# --target into this venv's site-packages, --no-deps; the wheel is not modified), and says so. Its
# Python modules are what tierstack uses; its one compiled module (the CUPTI straggler profiler)
# cannot load on such a machine and is never imported on the CPU path. Everything else is plain pip.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

is_312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }
find_python() {
  local c v
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  # python3.12 on PATH may be a pyenv shim that fails when 3.12 is not selected: run it to know.
  c="$(command -v python3.12 2>/dev/null || true)"
  if is_312 "$c"; then echo "$c"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3 -n -r); do
      c="$(pyenv root)/versions/$v/bin/python3.12"
      if is_312 "$c"; then echo "$c"; return; fi
    done
  fi
}
PY="$(find_python)"
if ! is_312 "$PY"; then
  echo "tierstack needs Python 3.12 (megatron-core 0.19 requires >= 3.12; nvidia-resiliency-ext 0.7" >&2
  echo "ships wheels for 3.12). Found: ${PY:-no working python3.12 on PATH or in pyenv}${PY:+ ($("$PY" --version 2>&1 | head -n 1))}." >&2
  echo "Install Python 3.12 (e.g. 'pyenv install 3.12' or your distribution's python3.12 package)," >&2
  echo "or point PYTHON=/path/to/python3.12 at one." >&2
  exit 1
fi

venv="$root/.venv"
stamp="$venv/.tierstack-installed"
want="$(cat constraints.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)'; then
  echo "recreating $venv: it was made with $("$venv/bin/python" --version 2>&1), tierstack needs 3.12"
  rm -rf "$venv"
fi
# Room first: PyTorch with its CUDA libraries makes the venv about 6 GiB, and pip needs its downloads
# beside it. A full disk otherwise surfaces minutes later as pip's "OSError: [Errno 28]".
need_gib=8
free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { printf "%d", $4 / 1048576 }'; }
if [ ! -f "$stamp" ]; then  # a first install (an update installs only what changed)
  have="$(free_gib "$root")"
  if [ -n "$have" ] && [ "$have" -lt "$need_gib" ]; then
    echo "not enough disk space to install tierstack: $have GiB free on the file system of $root," >&2
    echo "about $need_gib GiB needed (the venv, PyTorch with its CUDA libraries: ~6 GiB; pip's downloads)." >&2
    echo "Free some space there (e.g. old virtualenvs, ~/.cache/pip) and run this again." >&2
    exit 1
  fi
fi
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet -c constraints.txt pip
pin() { grep -i -E "^$1==" constraints.txt | head -n 1; }
# torch first, alone and pinned: a dependency asking for plain `torch` must find it satisfied.
"${pip[@]}" install --quiet -c constraints.txt "$(pin torch)"

nvrx="$(pin nvidia-resiliency-ext)"
glibc="$("$venv/bin/python" -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split()[1])')"
if "$venv/bin/python" -c 'import sys; a, b = map(int, sys.argv[1].split(".")[:2]); sys.exit(0 if (a, b) >= (2, 39) else 1)' "$glibc"; then
  "${pip[@]}" install --quiet --no-deps "$nvrx"
elif ! "$venv/bin/python" -m pip show -q nvidia-resiliency-ext >/dev/null 2>&1; then
  machine="$(uname -m)"
  echo "glibc $glibc < 2.39: pip refuses $nvrx's manylinux_2_39 wheel here; installing it with"
  echo "  pip --platform manylinux_2_39_$machine --only-binary=:all: --no-deps --target <venv site-packages>"
  echo "  (its Python modules run here; its CUPTI profiler module needs a newer libstdc++ and is not used on CPU)"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
  "${pip[@]}" install --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform "manylinux_2_39_$machine" --target "$site" "$nvrx"
fi
# pip --target puts the wheel's console scripts (ft_launcher, ...) under <site-packages>/bin; their
# shebang is this venv's python: move them where the venv's other commands are.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
if [ -d "$site/bin" ]; then
  mv -f "$site/bin/"* "$venv/bin/" 2>/dev/null || true
  rmdir "$site/bin" 2>/dev/null || true
fi
# The rest, including NVRx's own dependencies (pip resolves them from its installed metadata).
"${pip[@]}" install --quiet -c constraints.txt -e ".[test]"
echo "$want" > "$stamp"
echo "tierstack installed in $venv ($("$venv/bin/python" --version))"
