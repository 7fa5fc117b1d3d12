"""tierstack: Megatron-style LLM pretraining with LOCAL and GLOBAL checkpoint tiers.

Entry point: :func:`pretrain` with a :class:`ConfigContainer`.
"""

# First: installs the filters of the warnings that say nothing about a run (tierstack.runtime.known_warnings)
# before torch and megatron-core are imported.
from tierstack import runtime as _runtime  # noqa: F401, I001

from tierstack.config import ConfigContainer, ConfigError  # noqa: E402


def pretrain(config, forward_step_func=None, on_step=None):
    """See :func:`tierstack.training.pretrain.pretrain` (imported lazily: megatron-core is slow to import)."""
    from tierstack.training.pretrain import pretrain as _pretrain

    return _pretrain(config, forward_step_func, on_step)


__all__ = ["ConfigContainer", "ConfigError", "pretrain"]
__version__ = "0.1.0"  # the one place of the version (pyproject.toml reads it; see CHANGELOG.md)
