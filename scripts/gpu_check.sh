#!/usr/bin/env bash
# GPU readiness check: one run on a machine with 1-8 GPUs that exercises what CPU CI cannot.
#
#   bash scripts/gpu_check.sh              # run it (about 5 minutes once installed)
#   bash scripts/gpu_check.sh --dry-run    # print the steps it would take; runs nothing (works on CPU)
#   bash scripts/gpu_check.sh --skip-install
#
# Steps: install the GPU extra from the constraints (transformer-engine from wheels only: no source
# build), the main job's model (recipes/gpt_tiny.py) with the transformer-engine spec, bf16, NCCL,
# LOCAL (always asynchronous) and async GLOBAL saves, 30 iterations, killed (SIGKILL) once every rank
# has sealed its LOCAL checkpoint of step 15 (its manifest, written after the file) and resumed from LOCAL, the functional suite with TIERSTACK_TEST_DEVICE=gpu, and the checkpoint
# benchmark at its default scale. Each step has a time limit; a failing step does not stop the
# others. Ends with one summary table; exit status 1 when any step failed.
# Environment: GPU_CHECK_DIR (default runs/gpu_check), PYTHON (default python3.11), NGPU (default: all).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

dry=0
install=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --skip-install) install=0 ;;
    *) echo "usage: $0 [--dry-run] [--skip-install]" >&2; exit 2 ;;
  esac
done

out="${GPU_CHECK_DIR:-runs/gpu_check}"
venv="$root/.venv"
py="$venv/bin/python"
if [ -n "${NGPU:-}" ]; then
  ngpu="$NGPU"
elif command -v nvidia-smi >/dev/null 2>&1; then
  ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
else
  ngpu=0
fi
[ "$ngpu" -gt 8 ] && ngpu=8
if [ "$dry" = 1 ] && [ "$ngpu" -lt 1 ]; then
  echo "(dry run: no GPU here; showing the steps for a 2-GPU machine)"
  ngpu=2
fi
if [ "$ngpu" -ge 2 ]; then nproc=$((ngpu / 2 * 2)); tp=2; else nproc=1; tp=1; fi
dp=$((nproc / tp))
torchrun="$venv/bin/torchrun --standalone --nproc-per-node $nproc"

main_args=(
  recipes/gpt_tiny.py
  model.transformer_impl=transformer_engine model.bf16=true
  distributed.tensor_model_parallel_size=$tp distributed.backend=nccl
  train.train_iters=30 train.global_batch_size=$((8 * dp)) train.eval_interval=null
  checkpoint.async_save=true checkpoint.save_interval=20
  checkpoint.local_save_interval=5 checkpoint.most_recent_k=-1
  "logger.run_dir=$out/main" "checkpoint.save=$out/main/checkpoints" "checkpoint.local_dir=$out/main/local"
  logger.progress_bar=false mlflow=null
)

names=()
results=()
secs=()
notes=()

record() {  # name status seconds note
  names+=("$1"); results+=("$2"); secs+=("$3"); notes+=("$4")
}

step() {  # name timeout_s note command...
  local name="$1" limit="$2" note="$3"
  shift 3
  echo
  echo "== $name (limit ${limit}s): $*"
  if declare -F "$1" >/dev/null; then
    echo "   runs: $torchrun ${main_args[*]}"
  fi
  if [ "$dry" = 1 ]; then
    record "$name" "DRY-RUN" "-" "$note"
    return 0
  fi
  local t0=$SECONDS rc
  if declare -F "$1" >/dev/null; then
    "$@" >"$out/logs/$name.log" 2>&1  # a function of this script: bounded inside
  else
    timeout "$limit" "$@" >"$out/logs/$name.log" 2>&1
  fi
  rc=$?
  local status=PASS
  [ $rc -eq 124 ] && status=TIMEOUT
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAIL($rc)"
  record "$name" "$status" "$((SECONDS - t0))" "$note; log $out/logs/$name.log"
  [ $rc -eq 0 ]
}

kill_after_local_step() {  # the main job, SIGKILLed once every rank has its LOCAL checkpoint of step 15
  setsid $torchrun "${main_args[@]}" &
  local pid=$! waited=0
  # Polled every 0.1 s: a step of this small model takes tens of milliseconds on a GPU. A rank's
  # LOCAL step is sealed when its manifest (iter_<step>_<rank>_local.manifest.json) exists.
  while kill -0 "$pid" 2>/dev/null && [ $waited -lt 2400 ]; do
    if [ "$(find "$out/main/local" -name 'iter_0000015_*_local.manifest.json' 2>/dev/null | wc -l)" -ge "$nproc" ]; then
      kill -9 -- "-$pid"
      wait "$pid" 2>/dev/null
      echo "killed the run (SIGKILL to its process group) after LOCAL step 15"
      return 0
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  echo "the run ended or stalled before its LOCAL checkpoint of step 15" >&2
  kill -9 -- "-$pid" 2>/dev/null
  return 1
}

resume_from_local() {  # the same command again: must resume from LOCAL and finish 30 iterations
  timeout 240 $torchrun "${main_args[@]}" 2>&1 | tee "$out/logs/resume-output.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] && grep -qi "resumed from LOCAL checkpoint" "$out/logs/resume-output.txt"
}

echo "tierstack GPU check: $ngpu GPU(s) -> $nproc ranks, TP=$tp, DP=$dp; output under $out"
if [ "$dry" = 0 ]; then
  rm -rf "$out/main"
  mkdir -p "$out/logs"
fi

if [ "$install" = 1 ]; then
  step install 1200 "GPU extra from constraints; transformer-engine from wheels only" \
    bash -c "{ [ -x '$py' ] || ${PYTHON:-python3.11} -m venv '$venv'; } && '$py' -m pip install -q -c constraints.txt \
--only-binary=transformer-engine,transformer-engine-cu12,transformer-engine-torch -e '.[gpu,test]'"
else
  record install SKIPPED - "--skip-install"
fi
step environment 120 "torch CUDA build, NCCL, transformer-engine, fused-kernel flags" \
  "$py" -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count()); \
import transformer_engine; print('transformer-engine', transformer_engine.__version__); \
from tierstack.runtime import fusion_flags; print(fusion_flags(activation_func='gelu', gated_linear_unit=False, add_bias_linear=True))"
step main-kill 240 "TE spec, bf16, NCCL, async LOCAL+GLOBAL; SIGKILL after LOCAL step 15" kill_after_local_step
step main-resume 240 "same command: resumes from LOCAL, finishes 30 iterations" resume_from_local
step functional 300 "TIERSTACK_TEST_DEVICE=gpu (tests needing more GPUs than present are skipped)" \
  env TIERSTACK_TEST_DEVICE=gpu "$py" -m pytest tests/functional_tests -q -x -p no:cacheprovider -rs
if [ "$nproc" -ge 2 ]; then
  step benchmark 180 "scripts/bench_checkpoint.py, default scale (gpt_tiny, TP=2)" \
    $torchrun scripts/bench_checkpoint.py
else
  record benchmark SKIPPED - "needs 2 GPUs (gpt_tiny is TP=2)"
fi

echo
echo "== tierstack GPU check summary ($ngpu GPU(s), $nproc ranks, TP=$tp)"
printf '%-12s %-10s %8s  %s\n' step status seconds note
printf '%-12s %-10s %8s  %s\n' ------------ ---------- -------- ----
failed=0
for i in "${!names[@]}"; do
  printf '%-12s %-10s %8s  %s\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}" "${notes[$i]}"
  case "${results[$i]}" in PASS | SKIPPED | DRY-RUN) ;; *) failed=1 ;; esac
done
exit $failed
