"""One keyword-only dataclass per config section.

Every field has a comment saying what it means and its unit. ``None`` turns a feature off.
Cross-field checks live in :mod:`tierstack.config.container` (``ConfigContainer.validate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class ModelConfig:
    """GPT architecture (megatron-core ``TransformerConfig`` subset)."""

    num_layers: int = 4  # transformer layers; must divide by distributed.pipeline_model_parallel_size
    hidden_size: int = 256  # model width
    num_attention_heads: int = 8  # must divide by distributed.tensor_model_parallel_size
    ffn_hidden_size: Optional[int] = None  # MLP width; None = 4 * hidden_size
    seq_length: int = 256  # tokens per sample
    make_vocab_size_divisible_by: int = 4  # vocab is padded to a multiple of this * TP (Megatron rule)
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    share_embeddings_and_output_weights: bool = True
    transformer_impl: str = "auto"  # "auto" (TE when importable), "local" or "transformer_engine"
    bf16: bool = False  # bf16 parameters (GPU); CPU runs use fp32


@dataclass(kw_only=True)
class TrainConfig:
    """Loop length and batch sizes (in samples)."""

    train_iters: int = 200  # optimizer steps
    micro_batch_size: int = 8  # samples per forward/backward per data-parallel rank
    global_batch_size: int = 8  # samples per optimizer step; multiple of micro_batch_size * DP
    eval_interval: Optional[int] = 50  # iterations between validation runs; None = never
    eval_iters: int = 4  # global batches per validation run
    exit_interval: Optional[int] = None  # stop (after checkpointing) when iteration % this == 0


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam over megatron-core ``get_megatron_optimizer``."""

    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # floor of the cosine decay
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    use_distributed_optimizer: bool = False  # shard optimizer state across data-parallel ranks


@dataclass(kw_only=True)
class SchedulerConfig:
    """LR schedule (megatron-core ``OptimizerParamScheduler``)."""

    lr_warmup_iters: int = 20  # linear warmup length in iterations
    lr_decay_iters: Optional[int] = None  # None = train.train_iters
    lr_decay_style: str = "cosine"  # constant, linear, cosine, inverse-square-root, WSD
    start_weight_decay: Optional[float] = None  # None = optimizer.weight_decay
    end_weight_decay: Optional[float] = None  # None = optimizer.weight_decay


@dataclass(kw_only=True)
class DatasetConfig:
    """Training data. ``data_path`` None means the built-in corpus (Python standard library sources)."""

    data_path: Optional[list] = None  # Megatron indexed-dataset prefixes (without .bin/.idx), or [w1, p1, w2, p2] to blend
    split: str = "98,2,0"  # train,valid,test weights over documents
    mock: bool = False  # synthetic tokens (fast tests); no files read
    cache_dir: str = ".cache/tierstack"  # where the built-in corpus and dataset indices are cached
    num_workers: int = 0  # DataLoader workers per rank


@dataclass(kw_only=True)
class TokenizerConfig:
    """Tokenizer: byte-level (vocab 256 + end-of-document) or a local Hugging Face tokenizer.json."""

    tokenizer_type: str = "byte"  # "byte" or "huggingface"
    tokenizer_path: Optional[str] = None  # path to tokenizer.json when tokenizer_type == "huggingface"


@dataclass(kw_only=True)
class DistributedConfig:
    """Parallel layout. Data-parallel size is world_size / (TP * PP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    backend: Optional[str] = None  # None = nccl on GPU, gloo on CPU
    timeout_s: float = 600.0  # collective timeout in seconds


@dataclass(kw_only=True)
class CheckpointConfig:
    """Two checkpoint tiers. GLOBAL: persistent torch_dist; LOCAL: node-local per-rank (NVRx)."""

    save: Optional[str] = None  # GLOBAL checkpoint directory; None = no GLOBAL saves
    save_interval: Optional[int] = None  # iterations between GLOBAL saves
    load: Optional[str] = None  # GLOBAL directory to resume from; None = same as save
    ckpt_step: Optional[int] = None  # load this exact step instead of the newest
    # LOCAL checkpoint root: node-local disk, or a tmpfs such as /dev/shm/<run> (README says when); None = no LOCAL tier
    local_dir: Optional[str] = None
    local_save_interval: Optional[int] = None  # iterations between LOCAL saves
    most_recent_k: int = 2  # checkpoints kept per tier; -1 keeps all
    async_save: bool = False  # GLOBAL saves in a background writer (LOCAL saves always are)
    fully_parallel_save: bool = True  # spread GLOBAL writes over data-parallel ranks
    fully_parallel_load: bool = True
    save_optim: bool = True
    load_optim: bool = True
    save_rng: bool = True
    load_rng: bool = True
    # Fine-tuning: on a fresh start, load model weights only from this GLOBAL root or step directory;
    # counters, optimizer and LR schedule start fresh. A checkpoint of this run itself wins over it.
    pretrained_checkpoint: Optional[str] = None
    exit_on_missing_checkpoint: bool = False  # error if `load` is set but holds no checkpoint
    allow_fresh_start_on_invalid: bool = False  # start fresh when checkpoints exist but none is valid
    save_retries: int = 3  # attempts for transient I/O errors
    retry_backoff_s: float = 1.0  # first backoff in seconds (exponential)
    exit_on_save_failure: bool = False  # stop training when a save fails on any rank


@dataclass(kw_only=True)
class LoggerConfig:
    """Console progress and run directory."""

    run_dir: str = "runs/default"  # where logs, plots and the default mlflow store go
    log_interval: int = 10  # iterations between rank-0 log lines
    progress_bar: bool = True  # tqdm bar on rank 0


@dataclass(kw_only=True)
class RNGConfig:
    seed: int = 1234  # base seed; megatron-core offsets it per pipeline stage and TP rank


@dataclass(kw_only=True)
class StragglerConfig:
    """NVRx straggler detection (``nvidia_resiliency_ext.straggler.Detector``)."""

    report_interval: int = 20  # iterations between reports
    relative_threshold: float = 0.7  # rank flagged when its relative score is below this
    individual_threshold: float = 0.7  # rank flagged when its individual score is below this
    num_scores_to_print: int = 4  # slowest ranks listed in the log
    stop_if_detected: bool = False  # save GLOBAL and exit when a straggler is found
    profiling_interval: int = 1  # profile every n-th step


@dataclass(kw_only=True)
class MlflowConfig:
    """mlflow tracking; only rank 0 talks to mlflow."""

    tracking_uri: Optional[str] = None  # None = sqlite store inside logger.run_dir
    experiment_name: str = "tierstack"
    run_name: Optional[str] = None


SECTION_TYPES = {
    "model": ModelConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "dataset": DatasetConfig,
    "tokenizer": TokenizerConfig,
    "distributed": DistributedConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "rng": RNGConfig,
    "straggler": StragglerConfig,
    "mlflow": MlflowConfig,
}
