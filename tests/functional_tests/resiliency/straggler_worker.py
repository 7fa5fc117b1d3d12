"""torchrun worker: a timed loop in which one rank sleeps inside its step; writes what each rank saw.

Usage: torchrun --nproc-per-node 2 straggler_worker.py OUT_DIR SLOW_RANK [SLOWDOWN]

The slow rank sleeps SLOWDOWN times its own compute time of that step (default 4, so its step takes
about 5 times as long as the other rank's on any machine): the scores the test checks are ratios of
step times, so a sleep in proportion keeps them independent of the machine's speed.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from tierstack.config.sections import StragglerConfig
from tierstack.runtime import destroy_distributed, initialize_distributed
from tierstack.resiliency.straggler import StragglerMonitor


def main() -> None:
    out_dir, slow_rank = Path(sys.argv[1]), int(sys.argv[2])
    slowdown = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    layout = initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1)
    cfg = StragglerConfig(report_interval=8, stop_if_detected=True, num_scores_to_print=2)
    monitor = StragglerMonitor(cfg, layout)
    x = torch.randn(128, 128)
    reports = []
    try:
        for iteration in range(1, 41):
            with monitor.step_section():
                start = time.perf_counter()
                for _ in range(4):
                    x = torch.tanh(x @ x.T / 128)
                if layout.rank == slow_rank:
                    time.sleep(slowdown * (time.perf_counter() - start))
            report = monitor.maybe_report(iteration)
            if report is not None:
                reports.append(
                    {
                        "iteration": report.iteration,
                        "stragglers": report.stragglers,
                        "should_stop": report.should_stop,
                        "metrics": report.metrics,
                    }
                )
                if report.should_stop:
                    break
    finally:
        monitor.close()
    (out_dir / f"rank{layout.rank}.json").write_text(json.dumps({"reports": reports, "last_iteration": iteration}))
    destroy_distributed()


if __name__ == "__main__":
    main()
    from tierstack.runtime import process_exiting

    process_exiting()  # skip the final GC pass over torch's objects (0.7 s per rank)
