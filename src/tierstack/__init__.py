"""tierstack: Megatron-style LLM pretraining with LOCAL and GLOBAL checkpoint tiers.

Entry point: :func:`pretrain` with a :class:`ConfigContainer`.
"""

import warnings

# nvidia-resiliency-ext depends on the `pynvml` package; torch warns about it every time its CUDA
# module is imported. It says nothing about the run, so it is not repeated on every rank of every launch.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)

from tierstack.config import ConfigContainer, ConfigError  # noqa: E402


def pretrain(config, forward_step_func=None, on_step=None):
    """See :func:`tierstack.training.pretrain.pretrain` (imported lazily: megatron-core is slow to import)."""
    from tierstack.training.pretrain import pretrain as _pretrain

    return _pretrain(config, forward_step_func, on_step)


__all__ = ["ConfigContainer", "ConfigError", "pretrain"]
__version__ = "0.1.0"
