"""Names that Megatron-Bridge and Megatron-LM give to tierstack's fields: a hint, never an alias.

A key typed the Megatron-Bridge way (``checkpoint.non_persistent_ckpt_dir=...``) or with a
Megatron-LM flag's name (``seq_length=...`` under any section) is still refused as unknown, with one
more line: ``did you mean `checkpoint.local_dir` (Megatron-Bridge: `checkpoint.non_persistent_ckpt_dir`)?``.
The same table is printed in the README (a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ForeignName:
    """One row of the name map.

    Attributes:
        ours: the tierstack key (``section.field``).
        bridge: the Megatron-Bridge key (``section.field`` of its ConfigContainer), or None.
        megatron_lm: the Megatron-LM flag (``--seq-length``), or None.
        note: how the meaning differs (units, inverted sense), or "".
    """

    ours: str
    bridge: Optional[str]
    megatron_lm: Optional[str]
    note: str = ""


NAME_MAP: tuple[ForeignName, ...] = (
    ForeignName("checkpoint.local_dir", "checkpoint.non_persistent_ckpt_dir", "--non-persistent-ckpt-dir"),
    ForeignName("checkpoint.local_save_interval", "checkpoint.non_persistent_save_interval",
                "--non-persistent-save-interval"),
    ForeignName("distributed.tensor_model_parallel_size", "model.tensor_model_parallel_size",
                "--tensor-model-parallel-size"),
    ForeignName("distributed.pipeline_model_parallel_size", "model.pipeline_model_parallel_size",
                "--pipeline-model-parallel-size"),
    ForeignName("model.seq_length", "dataset.seq_length", "--seq-length"),
    ForeignName("model.seq_length", "dataset.sequence_length", None, "megatron-core GPTDatasetConfig's name"),
    ForeignName("model.vocab_size", "tokenizer.vocab_size", "--vocab-size"),
    ForeignName("model.layernorm_epsilon", None, "--norm-epsilon"),
    ForeignName("model.share_embeddings_and_output_weights", None, "--untie-embeddings-and-output-weights",
                "inverted: untied is share_embeddings_and_output_weights=false"),
    ForeignName("model.gated_linear_unit", None, "--swiglu",
                "SwiGLU is model.gated_linear_unit=true model.activation_func=silu"),
    ForeignName("tokenizer.tokenizer_path", "tokenizer.tokenizer_model", "--tokenizer-model",
                "a tokenizer.json file or its directory"),
    ForeignName("dataset.data_path", "dataset.blend", None,
                "one prefix, a list, or Megatron's weighted \"0.3 /a 0.7 /b\""),
    ForeignName("train.eval_interval", "validation.eval_interval", None),
    ForeignName("train.eval_iters", "validation.eval_iters", None),
    ForeignName("optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer", None),
    ForeignName("distributed.backend", "dist.distributed_backend", "--distributed-backend"),
    ForeignName("distributed.timeout_s", "dist.distributed_timeout_minutes", "--distributed-timeout-minutes",
                "in seconds, not minutes"),
    ForeignName("rng.seed", None, "--seed"),
)


def _flag_name(flag: str) -> str:
    """``--seq-length`` -> ``seq_length`` (how a Megatron-LM flag would be typed as a field)."""
    return flag.lstrip("-").replace("-", "_")


def _said(row: ForeignName) -> str:
    """``Megatron-Bridge: `x`; Megatron-LM: `--y``` for the parenthesis of a hint."""
    names = []
    if row.bridge:
        names.append(f"Megatron-Bridge: `{row.bridge}`")
    if row.megatron_lm:
        names.append(f"Megatron-LM: `{row.megatron_lm}`")
    return "; ".join(names)


def hint(key: str) -> Optional[str]:
    """The "did you mean" line for an unknown ``section.field`` key, or None when it names nothing known.

    A full Megatron-Bridge key matches first (``model.tensor_model_parallel_size``); then the field
    name alone, under any section, as Megatron-Bridge or Megatron-LM spell it (``seq_length``,
    ``non_persistent_ckpt_dir``).
    """
    field = key.split(".")[-1]
    row = next((r for r in NAME_MAP if r.bridge == key), None)
    if row is None:
        row = next((r for r in NAME_MAP if (r.bridge and r.bridge.split(".")[-1] == field)
                    or (r.megatron_lm and _flag_name(r.megatron_lm) == field)), None)
    if row is None or row.ours == key:
        return None
    note = f"; {row.note}" if row.note else ""
    return f"did you mean `{row.ours}` ({_said(row)}{note})?"
