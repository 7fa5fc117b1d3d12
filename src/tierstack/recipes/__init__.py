"""Recipes: plain functions returning a :class:`~tierstack.config.ConfigContainer`, by name.

``RECIPES`` maps each name to its config function; ``tierstack pretrain <name>`` and the runnable
files under ``recipes/`` (``python recipes/gpt_tiny.py``, ``torchrun ... recipes/gpt_tiny.py``) run
the same function through :func:`run`. A new recipe is a module here with one ``*_config()``
function derived from :func:`gpt_config`, one line in ``RECIPES``, and (optionally) a runnable file.
"""

from typing import Callable

from tierstack.config import ConfigContainer
from tierstack.recipes.base import gpt_config
from tierstack.recipes.gpt_small import gpt_small_config
from tierstack.recipes.gpt_tiny import gpt_tiny_config
from tierstack.recipes.llama3_145m import llama3_145m_config
from tierstack.recipes.llama_tiny import llama_tiny_config
from tierstack.recipes.runner import launch, run

DEFAULT_RECIPE = "gpt_tiny"
RECIPES: dict[str, Callable[[], ConfigContainer]] = {
    "gpt_tiny": gpt_tiny_config,
    "gpt_small": gpt_small_config,
    "llama_tiny": llama_tiny_config,
    "llama3_145m": llama3_145m_config,
}

__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES",
    "gpt_config",
    "gpt_small_config",
    "gpt_tiny_config",
    "launch",
    "llama3_145m_config",
    "llama_tiny_config",
    "run",
]
