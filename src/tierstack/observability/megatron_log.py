"""``logger.format=megatron``: Megatron-LM's training log line and metric names, for existing scrapers.

The line has Megatron-LM's fields, labels, number formats and ``|`` separators (iteration, consumed
samples, elapsed time per iteration in ms, learning rate, global batch size, lm loss, loss scale,
grad norm, skipped and nan iterations), and a validation result gets Megatron's
``validation loss at iteration N | lm loss value: ... | lm loss PPL: ... |`` line. The experiment
tracker then records Megatron-LM's metric names (``lm loss``, ``learning-rate``, ``grad-norm``, ...).
Written from the format Megatron-LM prints; no code of it is used.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Mapping, Optional

from tierstack.config.sections import LOG_FORMATS  # noqa: F401 - the values of logger.format

MEGATRON = "megatron"  # logger.format
SKIPPED_ITERS = "skipped_iters"  # iterations of the interval whose update the optimizer skipped
NAN_ITERS = "nan_iters"  # iterations of the interval with a non-finite loss
LOSS_SCALE = 1.0  # tierstack scales no loss (fp32 on CPU, bf16 on GPU), which Megatron prints as 1.0

# tierstack metric -> Megatron-LM's name for it in TensorBoard / W&B / mlflow
METRIC_NAMES = {
    "loss": "lm loss",
    "val_loss": "lm loss validation",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "step_time_s": "iteration-time",
    "tflops_per_rank": "throughput",
}


def format_megatron_line(iteration: int, total_iters: int, metrics: Mapping[str, Any], global_batch_size: int,
                         now: Optional[datetime] = None) -> str:
    """Megatron-LM's training log line for one log interval.

    Args:
        iteration: the step just done; consumed samples are ``iteration * global_batch_size`` (no
            batch ramp-up in tierstack).
        total_iters: ``train.train_iters``.
        metrics: the loop's metrics (``loss``, ``lr``, ``grad_norm``, ``step_time_s`` in seconds,
            optional ``skipped_iters`` / ``nan_iters`` counts); a missing value is left out.
        global_batch_size: samples per iteration.
        now: the timestamp (default: the current local time).
    """
    stamp = (now or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    parts = [f" [{stamp}] iteration {iteration:8d}/{total_iters:8d} |",
             f" consumed samples: {iteration * global_batch_size:12d} |"]
    step_time = metrics.get("step_time_s")
    if step_time is not None and math.isfinite(step_time):
        parts.append(f" elapsed time per iteration (ms): {float(step_time) * 1000.0:.1f} |")
    if metrics.get("lr") is not None:
        parts.append(f" learning rate: {float(metrics['lr']):.6E} |")
    parts.append(f" global batch size: {global_batch_size:5d} |")
    if metrics.get("loss") is not None:
        parts.append(f" lm loss: {float(metrics['loss']):.6E} |")
    parts.append(f" loss scale: {LOSS_SCALE:.1f} |")
    if metrics.get("grad_norm") is not None:
        parts.append(f" grad norm: {float(metrics['grad_norm']):.3f} |")
    parts.append(f" number of skipped iterations: {int(metrics.get(SKIPPED_ITERS, 0)):3d} |")
    parts.append(f" number of nan iterations: {int(metrics.get(NAN_ITERS, 0)):3d} |")
    return "".join(parts)


def format_megatron_validation(iteration: int, val_loss: float) -> str:
    """Megatron-LM's validation result line: the loss (nats per token) and its perplexity."""
    ppl = math.exp(min(20.0, val_loss))  # Megatron caps the exponent at 20 the same way
    return f" validation loss at iteration {iteration} | lm loss value: {val_loss:.6E} | lm loss PPL: {ppl:.6E} | "


def tracker_metrics(log_format: str, metrics: Mapping[str, Any], global_batch_size: int) -> dict[str, Any]:
    """The metrics as the experiment tracker records them: unchanged, or with Megatron-LM's names
    (plus its ``batch-size`` and ``loss-scale``) for ``logger.format=megatron``."""
    if log_format != MEGATRON:
        return dict(metrics)
    out = {METRIC_NAMES.get(k, k): v for k, v in metrics.items()}
    out.update({"batch-size": global_batch_size, "loss-scale": LOSS_SCALE})
    return out
