"""The GPT forward step handed to megatron-core's pipeline schedules."""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch

from tierstack import runtime


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses under ``loss_mask`` plus the token count.

    Args:
        loss_mask: ``[batch, seq]`` float, 1 where a token counts.
        output_tensor: ``[batch, seq]`` float32 per-token cross-entropy (megatron ``GPTModel`` with
            labels returns this).

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``: the three-tuple form of
        megatron-core 0.16 schedules, which divide by the token count and the number of
        micro-batches themselves, so gradients are a per-token mean.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def gpt_forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
    """Forward one micro-batch through a ``GPTModel`` stage.

    Every stage reads the batch (first stage needs tokens, last stage labels); a batch is the dict
    megatron's ``GPTDataset`` yields, collated: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, each ``[micro_batch, seq_length]``.

    Returns:
        ``(output_tensor, loss_func)`` as megatron-core's ``forward_step_func`` contract requires.
    """
    batch = next(data_iterator)
    dev = runtime.device()
    tokens = batch["tokens"].to(dev, non_blocking=True).long()
    labels = batch["labels"].to(dev, non_blocking=True).long()
    loss_mask = batch["loss_mask"].to(dev, non_blocking=True)
    position_ids = batch["position_ids"].to(dev, non_blocking=True).long()
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(dev, non_blocking=True)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(masked_token_loss, loss_mask)
