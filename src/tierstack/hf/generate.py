"""``tierstack generate``: sample text from a GLOBAL checkpoint.

One process (TP=1), or under torchrun with ``WORLD_SIZE`` = the tensor-parallel size (pipeline
size 1): every rank runs the model on its shard, the logits are gathered over TP ranks, rank 0
picks the next token and broadcasts it. Each step recomputes the whole sequence (no KV cache):
simple and exact, meant for checking what a checkpoint learned, not for serving.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tierstack.config import DistributedConfig
from tierstack.hf import checkpoint_io


@dataclass
class Generation:
    """Result of :func:`generate`: prompt ids, new ids (int), and the new text decoded."""

    prompt_ids: list
    new_ids: list
    text: str


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        max_new_tokens: tokens to add at most (generation also stops at the end-of-document token).
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probabilities sum to at least p (1 = all).
        seed: seed of the sampling generator (same seed, same tokens).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def problems(self) -> list:
        p = []
        if self.max_new_tokens < 1:
            p.append(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            p.append(f"--temperature {self.temperature}: must be >= 0")
        if self.top_k < 0:
            p.append(f"--top-k {self.top_k}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            p.append(f"--top-p {self.top_p}: must be in (0, 1]")
        return p


def next_token(logits: torch.Tensor, s: SamplingConfig, generator: torch.Generator) -> int:
    """Pick one id from fp32 ``logits`` ``[vocab]`` (greedy at temperature 0, else top-k/top-p sampling)."""
    if s.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= s.top_p  # keep the token that crosses p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _last_logits(model, ids: list, vocab: int) -> torch.Tensor:
    """fp32 logits ``[vocab]`` of the next token after ``ids`` (gathered over TP ranks)."""
    from megatron.core import tensor_parallel

    from tierstack import runtime

    dev = runtime.device()
    tokens = torch.tensor([ids], dtype=torch.long, device=dev)
    position_ids = torch.arange(len(ids), device=dev)[None]
    logits = model(tokens, position_ids, None)[:, -1:, :]  # [1, 1, padded vocab / TP]
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous())
    return logits[0, -1, :vocab].float().cpu()


def generate(load: str | Path, prompt: str, sampling: Optional[SamplingConfig] = None) -> Generation:
    """Continue ``prompt`` with the model of a GLOBAL checkpoint (``ROOT`` or ``ROOT/iter_N``).

    Raises:
        ValueError: bad sampling settings (names the flag), an empty prompt, or a prompt longer
            than the learned position table.
        CheckpointNotFoundError: ``load`` is not a published GLOBAL checkpoint.
    """
    import torch.distributed as dist

    from tierstack.data.tokenizers import build_tokenizer
    from tierstack.models.gpt import model_vocab_size

    s = sampling or SamplingConfig()
    if s.problems():
        raise ValueError("; ".join(s.problems()))
    step_dir = checkpoint_io.resolve_step_dir(load)
    cfg = checkpoint_io.read_run_config(step_dir)
    tp = checkpoint_io.torchrun_world_size() or 1
    cfg = dataclasses.replace(cfg, distributed=dataclasses.replace(
        DistributedConfig(), tensor_model_parallel_size=tp, backend=cfg.distributed.backend), mlflow=None, straggler=None)
    m = cfg.model
    problems = m.problems()
    for name, count in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups)):
        if count is not None and count >= 1 and count % tp:  # megatron-core splits heads over TP ranks
            problems.append(f"model.{name}={count} is not divisible by TP={tp}")
    if problems:
        raise ValueError(f"cannot generate with TP={tp} (torchrun ranks): " + "; ".join(problems))
    tok = build_tokenizer(cfg.tokenizer)
    vocab = model_vocab_size(cfg, tok)
    ids = list(tok.tokenize(prompt))
    if not ids:
        raise ValueError("--prompt: empty after tokenization")
    limit = cfg.model.max_position_embeddings or cfg.model.seq_length
    if cfg.model.position_embedding_type == "learned_absolute" and len(ids) >= limit:
        raise ValueError(f"--prompt: {len(ids)} tokens; the model's position table has {limit} rows")
    new: list = []
    with checkpoint_io.parallel_world(cfg):
        model = checkpoint_io.load_model_weights(cfg, step_dir).model[0]
        gen = torch.Generator().manual_seed(s.seed)
        with torch.no_grad():
            for _ in range(s.max_new_tokens):
                if cfg.model.position_embedding_type == "learned_absolute" and len(ids) + len(new) >= limit:
                    break
                logits = _last_logits(model, ids + new, vocab)
                box = [next_token(logits, s, gen)]
                if dist.get_world_size() > 1:
                    dist.broadcast_object_list(box, src=0)  # every rank continues with rank 0's choice
                new.append(box[0])
                if box[0] == tok.eod:
                    break
    return Generation(prompt_ids=ids, new_ids=new, text=tok.detokenize(new))
