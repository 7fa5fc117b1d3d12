"""What straggler detection costs per training step, measured side by side in one run.

Runs a small GPT training step (forward, backward, Adam; 1 rank, TP=1) alternately with and without
the nvidia-resiliency-ext Detector around it, the way tierstack uses it: the step timed as the
``train_step`` section, the forward step as ``forward_step``, and ``maybe_report`` after every step
(a report, a collective, every ``--report-interval`` steps; its cost is included in those steps).
Prints median step times, the ratio, and the mean time of one report.

Run: .venv/bin/python scripts/bench_straggler.py [--reps 20] [--report-interval 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20, help="steps of each kind (interleaved)")
    ap.add_argument("--report-interval", type=int, default=5, help="detector steps between reports")
    args = ap.parse_args()
    from tierstack.recipes import gpt_tiny_config

    from tierstack import runtime
    from tierstack.config.sections import StragglerConfig
    from tierstack.models.gpt import gpt_model_provider
    from tierstack.resiliency.straggler import StragglerMonitor

    cfg = gpt_tiny_config()
    cfg.distributed.tensor_model_parallel_size = 1
    layout = runtime.initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1)
    model = gpt_model_provider(cfg, 257)()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    mb, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, 257, (mb, s), device=runtime.device())
    pos = torch.arange(s, device=runtime.device()).unsqueeze(0).expand(mb, -1)

    def forward():
        return model(tokens, pos, None, labels=tokens).float().mean()

    def train_step(fwd):
        loss = fwd()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        runtime.synchronize()

    monitor = StragglerMonitor(
        StragglerConfig(report_interval=args.report_interval, relative_threshold=0.01, individual_threshold=0.01),
        layout,
    )
    timed_forward = monitor.wrap_forward_step(forward)
    with_det, without, report_s = [], [], []
    try:
        train_step(forward)  # warm-up
        for i in range(1, args.reps + 1):
            t0 = time.perf_counter()
            with monitor.step_section():
                train_step(timed_forward)
            t1 = time.perf_counter()
            report = monitor.maybe_report(i)
            t2 = time.perf_counter()
            with_det.append(t2 - t0)
            if report is not None:
                report_s.append(t2 - t1)

            t0 = time.perf_counter()
            train_step(forward)
            without.append(time.perf_counter() - t0)
    finally:
        monitor.close()
    a, b = statistics.median(with_det), statistics.median(without)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731 - the report steps are outliers by design
    print(f"gpt_tiny at TP=1, micro-batch {mb} x {s} tokens, {args.reps} steps each, interleaved, "
          f"{'CUDA kernel profiling' if runtime.has_gpu() else 'CPU: section timing only'}")
    print(f"median step time with the detector:    {a * 1000:8.1f} ms (mean {mean(with_det) * 1000:.1f})")
    print(f"median step time without the detector: {b * 1000:8.1f} ms (mean {mean(without) * 1000:.1f})")
    print(f"ratio with/without (median): {a / b:.4f}  (overhead {100 * (a / b - 1):+.2f}%); "
          f"mean ratio {mean(with_det) / mean(without):.4f}")
    if report_s:
        print(f"one report (every {args.report_interval} steps): {mean(report_s) * 1000:.2f} ms on average")
    runtime.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
