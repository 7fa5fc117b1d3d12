"""Warnings that say nothing about a run, filtered one by one (by message and module), never in bulk.

On a CPU, megatron-core 0.16.1 warns on every rank that Transformer Engine and Apex are missing (six
times, at the import of each module with a fused kernel) and that ``CUDA_DEVICE_MAX_CONNECTIONS``
is unset (a CUDA stream setting); torch warns at import that the ``pynvml`` package (an
nvidia-resiliency-ext dependency) is deprecated, and at every LOCAL replica exchange that
nvidia-resiliency-ext calls a deprecated helper, and at a resharding GLOBAL load that megatron-core
uses torch APIs torch deprecates. megatron-core 0.19 adds notices at import (``absl`` not installed,
``MimoModelConfig`` experimental, ``GPTModel`` deprecated in favour of its ``HybridModel``, which
tierstack's users cannot act on) and one at the first async save about its own async path, which the
GLOBAL tier chooses on purpose (``checkpointing.global_writer`` says why); torch's CUDA wheel says at
import on a CPU machine that no CUDA runtime is found; in a process that is no rank (the launcher,
``convert``, ``generate``), megatron-core says it found no rank and torch's distributed checkpoint
that it loads in one process. None of them changes what a run computes.
Log records are filtered like warnings: by logger name and message, one by one (:data:`_LOG_RECORDS`).
:func:`install_import_filters` and :func:`install_cpu_filters` ignore exactly those warnings, each
matched by its message and the module that issues it; every other warning stays visible.
:func:`absent_gpu_packages` gives the one line a run prints instead.

This module imports nothing heavy, so the import-time filters can be installed before torch loads.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings

# (message regex, category, module regex): warnings.filterwarnings matches the message from its
# start and the module name of the code calling warnings.warn.
_IMPORT_TIME = (
    # torch.cuda imports pynvml at import; nvidia-resiliency-ext depends on that package.
    (r"The pynvml package is deprecated", FutureWarning, r"torch\.cuda\Z"),
    # nvidia-resiliency-ext 0.4.1's replication (its copy of torch's object collectives) asks torch
    # for a group's device through a helper torch now deprecates, which also warns when the group
    # has both a CPU and a GPU backend: two warnings per exchange and retrieval, about their code.
    (r"`_get_pg_default_device` will be deprecated", UserWarning,
     r"nvidia_resiliency_ext\.checkpointing\.local\.replication\._torch_future\Z"),
    (r"Multiple backends are registered with this ProcessGroup", UserWarning,
     r"nvidia_resiliency_ext\.checkpointing\.local\.replication\._torch_future\Z"),
    # megatron-core 0.16.1's torch_dist load (dist_checkpointing/strategies/torch.py) calls
    # torch.distributed.checkpoint's deprecated load_state_dict and builds ShardedTensors, which torch
    # deprecates: once per rank at every GLOBAL load with another topology (a resharding resume).
    # On the CPU the ShardedTensor call passes through cpu_compat's torch-function mode.
    (r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load` instead",
     FutureWarning, r"megatron\.core\.dist_checkpointing\.strategies\.torch\Z"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"(megatron\.core\.dist_checkpointing\..*|tierstack\.runtime\.cpu_compat)\Z"),
    # megatron-core 0.19 at import: absl-py is optional for its logging; MimoModelConfig (multimodal) is new.
    (r"absl\.logging is not installed", UserWarning, r"megatron\.core\.hyper_comm_grid\Z"),
    (r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\.models\.mimo\..*\Z"),
    # megatron-core 0.19 in a process that is no rank (the launcher, preprocess, convert): its logging
    # helper asks for a rank and warns that it found none (the process is rank 0 of nothing).
    (r"Could not determine rank from torch\.distributed", UserWarning, r"megatron\.core\._rank_utils\Z"),
    # megatron-core's torch_dist load in one process without torch.distributed (convert export,
    # generate: by design) goes through torch.distributed.checkpoint, which says it assumes one
    # process, and that the positional arguments megatron-core passes were reordered long ago.
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (load|save) in a "
     r"single process", UserWarning, r"torch\.distributed\.checkpoint\.(utils|logger)\Z"),
    (r"The argument order of load has been changed", UserWarning, r"torch\.distributed\.checkpoint\.(utils|logger)\Z"),
)
# (logger name, message regex): records that loggers (not warnings.warn) emit, matched from the start.
_LOG_RECORDS = (
    # megatron-core 0.19, once per process: the dense GPTModel is kept for bug fixes only.
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
    # megatron-core 0.19, at the first async save: async_strategy="mcore" is chosen (global_writer).
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated"),
    # megatron-core 0.19 reading a checkpoint of the legacy layout (common.pt; e.g. tierstack <= 0.x):
    # it still reads them, and says once per load that this reader will go.
    ("megatron.core.dist_checkpointing.strategies.common", r"load_common is deprecated"),
    # torch's CUDA wheel on a machine without CUDA, at the import of torch.utils.cpp_extension.
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
)


class _DropKnown(logging.Filter):
    """Drops the records of one logger whose message matches one of ``patterns``."""

    def __init__(self, patterns: list) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)
_CPU_ONLY = (
    # megatron/core/{optimizer/__init__,optimizer/optimizer,optimizer/clip_grads}.py and
    # distributed/fsdp/src/megatron_fsdp/mixed_precision.py: the fused CUDA kernels' fallbacks.
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning, r"megatron\.core\..*\Z"),
    # megatron/core/models/backends.py and models/gpt/gpt_layer_specs.py: Apex's fused norm.
    (r"Apex is not installed\. Falling back to Torch Norm\Z", UserWarning, r"megatron\.core\.models\..*\Z"),
    # megatron/core/tensor_parallel/layers.py: an environment variable for CUDA streams.
    (
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
        r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        r"megatron\.core\.tensor_parallel\.layers\Z",
    ),
)
GPU_PACKAGES = ("transformer_engine", "apex")  # optional: the `gpu` extra


def _install(entries) -> None:
    for message, category, module in entries:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def install_import_filters() -> None:
    """Filters for warnings and log records issued when torch and megatron-core are imported, or at
    their first use (install before ``import torch``). Idempotent."""
    _install(_IMPORT_TIME)
    by_logger: dict = {}
    for name, pattern in _LOG_RECORDS:
        by_logger.setdefault(name, []).append(pattern)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(patterns))


def install_cpu_filters() -> None:
    """Filters for megatron-core's warnings about missing CUDA packages and settings (CPU runs only)."""
    _install(_CPU_ONLY)


def absent_gpu_packages() -> list[str]:
    """The optional GPU packages (``GPU_PACKAGES``) that cannot be imported here, without importing them."""
    return [name for name in GPU_PACKAGES if importlib.util.find_spec(name) is None]
