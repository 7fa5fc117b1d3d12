"""torchrun worker: a tiny GPT pretrain() run with TensorBoard, W&B (offline) and mlflow on, that can
be killed (SIGKILL on rank 0, no clean-up at all) right after a given iteration.

Usage: torchrun --nproc-per-node 2 loggers_worker.py RUN_ROOT KILL_AT [section.field=value ...]
KILL_AT 0 kills nothing.
"""

import os
import signal
import sys

from tierstack.recipes import gpt_config
from tierstack.training.forward import gpt_forward_step
from tierstack.training.pretrain import pretrain


def main() -> None:
    run_root, kill_at, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    config = gpt_config(
        "tb", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, train_iters=30,
        micro_batch_size=2, global_batch_size=4, lr=1e-3, run_root=run_root,
    ).apply_overrides([
        "dataset.mock=true", "checkpoint.async_save=false", "checkpoint.save_interval=10",
        "checkpoint.local_save_interval=5", "train.eval_interval=5", "train.eval_iters=1",
        "logger.log_interval=1", "logger.progress_bar=false", "wandb.mode=offline", "wandb.tags=[e2e]",
        *overrides,
    ])
    rank = int(os.environ.get("RANK", "0"))

    def on_step(train_state, result) -> None:
        if rank == 0 and train_state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no flush, no atexit: what a node failure leaves

    state = pretrain(config, gpt_forward_step, on_step=on_step)
    if rank == 0:
        from tierstack.resiliency.time_budget import job_start_time

        # the job's start as train.exit_duration_in_mins counts it (torchrun's agent), unix seconds
        print(f"JOB_START {job_start_time():.3f}")
        print(f"FINAL step={state.step} resumed_from={state.resumed_from}")


if __name__ == "__main__":
    main()
    from tierstack.runtime import process_exiting

    process_exiting()
