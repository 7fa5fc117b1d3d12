"""What the CPU compatibility layer costs per training step, measured side by side in one run.

The layer's device-rewriting TorchFunctionMode adds one Python call per torch op. This script runs
the gpt_tiny model's forward + backward (1 rank, TP=1) alternately with the mode active and
suspended, and prints the median step times, their ratio and the op count per step.

Run: .venv/bin/python scripts/bench_cpu_compat.py [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode


class _CountOps(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from tierstack.recipes import gpt_tiny_config

    from tierstack import runtime
    from tierstack.models.gpt import gpt_model_provider
    from tierstack.runtime import cpu_compat

    if runtime.has_gpu():
        print("CUDA is available: the CPU compatibility layer is not used on this machine.")
        return 0
    cfg = gpt_tiny_config()
    cfg.distributed.tensor_model_parallel_size = 1
    runtime.initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1)
    model = gpt_model_provider(cfg, 257)()
    mb, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, 257, (mb, s))
    pos = torch.arange(s).unsqueeze(0).expand(mb, -1)

    def step():
        t0 = time.perf_counter()
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    counter = _CountOps()
    with counter:
        step()
    with_mode, without = [], []
    step()
    for _ in range(args.reps):
        with_mode.append(step())
        with cpu_compat.suspended():
            without.append(step())
    a, b = statistics.median(with_mode), statistics.median(without)
    print(f"micro-batch {mb} x {s} tokens, gpt_tiny at TP=1, {args.reps} reps each, interleaved")
    print(f"torch ops per forward+backward: {counter.n}")
    print(f"median step time with the CPU layer:    {a * 1000:8.1f} ms (min {min(with_mode)*1000:.1f}, max {max(with_mode)*1000:.1f})")
    print(f"median step time without the CPU layer: {b * 1000:8.1f} ms (min {min(without)*1000:.1f}, max {max(without)*1000:.1f})")
    print(f"ratio with/without: {a / b:.4f}  (overhead {100 * (a / b - 1):+.2f}%)")
    runtime.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
