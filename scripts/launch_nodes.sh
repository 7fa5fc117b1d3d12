#!/usr/bin/env bash
# Simulate NODES nodes on this machine: one torchrun agent per node, one c10d rendezvous.
#
# usage: scripts/launch_nodes.sh [--max-restarts N] [--local-root DIR] NODES NPROC_PER_NODE RECIPE [section.field=value ...]
#
#   RECIPE          a recipe name (gpt_tiny, ...: run as `-m tierstack.cli pretrain RECIPE`) or a
#                   script path ending in .py (run as it is, e.g. recipes/gpt_tiny.py).
#   --max-restarts  forwarded to every agent (torchrun counts it per agent; the job-wide count is
#                   kept in the run directory, see README "Several nodes").
#   --local-root    where the node-local directories go (default: the run directory, i.e. the
#                   value of a logger.run_dir=... override, else runs/<recipe name>).
#
# Node i gets checkpoint.local_dir=<local-root>/node<i>/local, so the simulated nodes share
# nothing but the GLOBAL directory (checkpoint.save). Agents meet at a c10d rendezvous on
# 127.0.0.1 on a free port (picked here; agent 0 hosts the store). Ranks learn their node from
# torchrun's GROUP_RANK / LOCAL_WORLD_SIZE, exactly as on a real cluster; the rendezvous decides
# which agent becomes which node rank, not the order below.
#
# Exit status: 0 when every agent succeeded, else the first failed agent's status.
set -uo pipefail

MAX_RESTARTS=0
LOCAL_ROOT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --max-restarts=*) MAX_RESTARTS="${1#*=}"; shift ;;
    --local-root) LOCAL_ROOT="$2"; shift 2 ;;
    --local-root=*) LOCAL_ROOT="${1#*=}"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
if [[ $# -lt 3 ]]; then
  echo "usage: $0 [--max-restarts N] [--local-root DIR] NODES NPROC_PER_NODE RECIPE [section.field=value ...]" >&2
  exit 2
fi
NODES="$1"; NPROC="$2"; RECIPE="$3"; shift 3
if ! [[ "$NODES" =~ ^[1-9][0-9]*$ && "$NPROC" =~ ^[1-9][0-9]*$ && "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "launch_nodes.sh: NODES and NPROC_PER_NODE must be integers >= 1, --max-restarts an integer >= 0" \
       "(got NODES=$NODES NPROC_PER_NODE=$NPROC --max-restarts=$MAX_RESTARTS)" >&2
  exit 2
fi

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"
TORCHRUN="$(dirname "$PY")/torchrun"
[[ -x "$TORCHRUN" ]] || TORCHRUN="$(command -v torchrun)"

if [[ "$RECIPE" == *.py ]]; then
  PROGRAM=("$RECIPE"); NAME="$(basename "$RECIPE" .py)"
else
  PROGRAM=(-m tierstack.cli pretrain "$RECIPE"); NAME="$RECIPE"
fi
RUN_DIR="runs/$NAME"
for o in "$@"; do
  [[ "$o" == logger.run_dir=* ]] && RUN_DIR="${o#logger.run_dir=}"
done
LOCAL_ROOT="${LOCAL_ROOT:-$RUN_DIR}"

PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
RDZV_ID="tierstack-$$-$PORT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The agents are torchrun processes: they import torch without tierstack's warning filters
# (runtime/known_warnings.py), and each printed torch's pynvml deprecation notice.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:The pynvml package is deprecated:FutureWarning:torch.cuda}"
# torchrun (2.13) keeps one store, hosted by agent 0, across the restarts; the ranks' process groups
# use keys of their own start in it (src/tierstack/runtime/attempt_store.py), so nothing is set here.

PIDS=()
# A signal to this script goes to every agent (torchrun turns it into SIGTERM to its ranks, whose
# planned exit may still save), and the script returns only once every agent has exited: a caller
# that waits on it must not see the job over while ranks still write.
on_signal() {
  for p in "${PIDS[@]}"; do kill -"$1" "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  exit "$2"
}
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM

# Each agent looks at its ranks (and at whether another node asks for a restart) every 0.1 s, as
# torchrun >= 2.2 does by default (older ones: 5 s). A failed rank is noticed within 0.1 s by its agent
# and within another 0.1 s by the others: the detection part of a restart (scripts/bench_goodput.py).
for ((i = 0; i < NODES; i++)); do
  HOST=false; [[ $i -eq 0 ]] && HOST=true
  mkdir -p "$LOCAL_ROOT/node$i"
  "$TORCHRUN" --nnodes "$NODES" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "$RDZV_ID" \
    --rdzv-conf "is_host=$HOST" --monitor-interval 0.1 \
    "${PROGRAM[@]}" "$@" "checkpoint.local_dir=$LOCAL_ROOT/node$i/local" &
  PIDS+=($!)
done

STATUS=0
for i in "${!PIDS[@]}"; do
  wait "${PIDS[$i]}"; rc=$?
  [[ $rc -ne 0 ]] && echo "launch_nodes.sh: node $i's torchrun exited with status $rc" >&2
  [[ $STATUS -eq 0 && $rc -ne 0 ]] && STATUS=$rc
done
exit $STATUS
