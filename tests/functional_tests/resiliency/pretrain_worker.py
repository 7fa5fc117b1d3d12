"""torchrun worker: a tiny GPT pretrain() run in which one rank can be made slow.

Usage: torchrun --nproc-per-node 2 pretrain_worker.py RUN_ROOT SLOW_RANK SLOWDOWN [section.field=value ...]
SLOW_RANK -1 makes no rank slow. The slow rank sleeps inside its forward step, SLOWDOWN times the
time that forward step took: straggler scores are ratios of section times, so a sleep in proportion
flags the rank on a fast machine and on a loaded one alike. SLOWDOWN ``F:S`` sleeps at least ``S``
seconds too (a floor that a stall of another rank on shared cores cannot outweigh).
"""

import os
import sys
import time

from tierstack.recipes import gpt_config
from tierstack.training.forward import gpt_forward_step
from tierstack.training.pretrain import pretrain


def main() -> None:
    run_root, slow_rank, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
    factor, _, floor = sys.argv[3].partition(":")
    slowdown, floor_s = float(factor), float(floor or 0)
    config = gpt_config(
        "e2e",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        train_iters=16,
        micro_batch_size=2,
        global_batch_size=4,
        lr=1e-3,
        run_root=run_root,
    ).apply_overrides(
        [
            "dataset.mock=true",
            "checkpoint.async_save=false",
            "checkpoint.save_interval=8",
            "checkpoint.local_save_interval=2",
            "train.eval_interval=4",
            "train.eval_iters=1",
            "logger.log_interval=2",
            "logger.progress_bar=false",
            *overrides,
        ]
    )
    rank = int(os.environ.get("RANK", "0"))

    def forward_step(data_iterator, model):
        start = time.perf_counter()
        out = gpt_forward_step(data_iterator, model)
        if rank == slow_rank:
            time.sleep(max(slowdown * (time.perf_counter() - start), floor_s))
        return out

    state = pretrain(config, forward_step)
    if rank == 0:
        print(f"FINAL step={state.step} resumed_from={state.resumed_from} experiment_run_id={state.experiment_run_id}")


if __name__ == "__main__":
    main()
    from tierstack.runtime import process_exiting

    process_exiting()  # skip the final GC pass over torch's objects (0.7 s per rank)
