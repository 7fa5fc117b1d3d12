"""Train and evaluation steps over megatron-core's ``get_forward_backward_func``."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from tierstack import runtime
from tierstack.observability.timers import FORWARD_BACKWARD, OPTIMIZER, PhaseTimers

log = logging.getLogger(__name__)


_NO_TIMERS = PhaseTimers(enabled=False)


@dataclass
class StepResult:
    """What one optimizer step produced (identical on every rank).

    Attributes:
        loss: mean per-token training loss over the global batch (nats).
        grad_norm: global gradient norm before clipping, or nan when not reported.
        update_successful: False when the optimizer skipped the update (non-finite gradients).
        seconds: wall time of the step (forward, backward, optimizer), seconds.
        tokens: tokens in the global batch.
        local_loss_finite: this rank's own share of the loss was finite (differs between ranks;
            the checkpoint guard uses it to say which rank saw a non-finite loss).
    """

    loss: float
    grad_norm: float
    update_successful: bool
    seconds: float
    tokens: int
    local_loss_finite: bool = True


@dataclass(frozen=True)
class BatchShape:
    """The sizes a step needs, in samples and tokens (the config's numbers, nothing else).

    Attributes:
        micro_batch_size: samples per forward/backward on each data-parallel rank.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        seq_length: tokens per sample.
        data_parallel_size: data-parallel ranks.
    """

    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    data_parallel_size: int

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each data-parallel rank: global / (micro * DP)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def tokens(self) -> int:
        """Tokens in one global batch."""
        return self.global_batch_size * self.seq_length


def reduce_loss_across_ranks(losses_reduced: list[dict]) -> tuple[float, bool]:
    """Mean per-token loss of a global batch (the same value on every rank), and whether this
    rank's own contribution was finite (per rank).

    Only last-stage ranks hold losses; tensor-parallel peers hold the same ones, so only TP rank 0
    of the last stage contributes to one world all-reduce of ``[loss_sum, num_tokens]``.
    This is a sync point.
    """
    from megatron.core import parallel_state as ps

    acc = torch.zeros(2, dtype=torch.float64, device=runtime.device())
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        for item in losses_reduced:
            acc += item["lm loss"].to(acc)
    local_finite = torch.isfinite(acc).all().to(acc).reshape(1)  # read with the sum: one device sync
    dist.all_reduce(acc)
    loss_sum, tokens, finite = torch.cat([acc, local_finite]).tolist()
    return (loss_sum / tokens if tokens > 0 else float("nan")), bool(finite)


def run_schedule(
    forward_step_func: Callable, data_iterator: Iterator, model: list, shape: BatchShape, *, forward_only: bool
) -> list[dict]:
    """One global batch of ``shape`` through megatron-core's pipeline schedule (forward, and backward
    unless ``forward_only``); returns the last stage's per-micro-batch loss reports (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=shape.num_microbatches,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: list,
    optimizer,
    scheduler,
    shape: BatchShape,
    timers: Optional[PhaseTimers] = None,
) -> StepResult:
    """One optimizer step over a global batch of ``shape``.

    ``timers`` (the loop's :class:`~tierstack.observability.timers.PhaseTimers`) times the
    forward-backward and optimizer phases (each also an NVTX range on GPU); ``data_iterator`` is
    expected to be wrapped by ``timers.timed`` for the data phase.

    Raises:
        Whatever the forward step or megatron-core raise; the caller cleans up.
    """
    timers = timers if timers is not None else _NO_TIMERS
    start = time.perf_counter()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with timers.phase(FORWARD_BACKWARD):
        losses = run_schedule(forward_step_func, data_iterator, model, shape, forward_only=False)
    with timers.phase(OPTIMIZER):
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=1)
    loss, local_loss_finite = reduce_loss_across_ranks(losses)
    runtime.synchronize()
    timers.step_done()
    return StepResult(
        loss=loss,
        grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
        update_successful=bool(update_successful),
        seconds=time.perf_counter() - start,
        tokens=shape.tokens,
        local_loss_finite=local_loss_finite,
    )


@torch.no_grad()
def evaluate(
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: list,
    shape: BatchShape,
    eval_iters: int,
) -> float:
    """Mean per-token validation loss over ``eval_iters`` global batches of ``shape`` (same on all ranks)."""
    from megatron.core import parallel_state as ps

    for chunk in model:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        for _ in range(eval_iters):
            losses = run_schedule(forward_step_func, data_iterator, model, shape, forward_only=True)
            if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
                for item in losses:
                    total += item["lm loss"].double().cpu()
    finally:
        for chunk in model:
            chunk.train()
    total = total.to(runtime.device())
    dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def model_flops_per_iteration(
    *,
    global_batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    num_attention_heads: Optional[int] = None,
    num_query_groups: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
    gated_linear_unit: bool = False,
) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recomputation), in FLOPs.

    Each matrix multiply of an ``[m, k]`` by a ``[k, n]`` matrix costs ``2 m k n`` FLOPs forward and
    twice that backward, so 3x the forward count in all. Per token and layer, forward, with h the
    hidden size, a the attention heads, d = h / a the head size, g the query groups (key/value
    heads), f ``ffn_hidden_size`` and s the sequence length:

    - QKV projection ``2 h (a d + 2 g d)``, attention scores ``2 s a d`` and their weighted sum
      ``2 s a d`` (the full s x s matrix, causal half not discounted), output projection ``2 a d h``;
    - MLP ``2 h f`` for fc1 (x2 with a gated linear unit, which has gate and up), ``2 f h`` for fc2;
    - once per token, the output layer ``2 h V`` (V the padded vocabulary), tied or untied alike.

    With a = g, f = 4h and no gate this is eq. (3) of Narayanan et al. 2021, "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM": ``72 B s l h^2 (1 + s/(6h) +
    V/(12 h l))``; the grouped-query and gated terms follow Megatron-LM's
    ``num_floating_point_operations`` (megatron/training/training.py). B is the global batch in
    samples, l the layers. Norms, activations, softmax and embeddings lookups are not counted.

    ``num_attention_heads`` and ``num_query_groups`` matter only with grouped-query attention (both
    None: multi-head); ``ffn_hidden_size`` None is 4h; ``vocab_size`` is the padded vocabulary.
    """
    b, s, l, h = global_batch_size, seq_length, num_layers, hidden_size
    a = num_attention_heads or 1
    d = h // a
    g = num_query_groups or a
    f = ffn_hidden_size or 4 * h
    attention = 2 * h * (a * d + 2 * g * d) + 2 * 2 * s * a * d + 2 * a * d * h
    mlp = 2 * h * f * (2 if gated_linear_unit else 1) + 2 * f * h
    forward_per_token = l * (attention + mlp) + 2 * h * vocab_size
    return 3.0 * b * s * forward_per_token
