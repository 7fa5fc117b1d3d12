"""Keep megatron-core from loading torch's compiler stack on a CPU, where its fused kernels are off.

megatron-core 0.16.1 (``megatron/core/jit.py``) sets ``jit_fuser = torch.compile`` when it is
imported, and its fusion modules (``fusions/fused_bias_gelu.py``, ``fused_bias_dropout.py``,
``fused_bias_swiglu.py``, ...) decorate their kernels with it at import. ``torch.compile`` imports
``torch._dynamo`` and ``torch._inductor`` before it looks at its arguments: about 1.0-1.4 s of
single-threaded import on every rank of every launch and every restart (measured on this machine by
importing ``megatron.core.models.gpt`` with and without this hook).

Most of those functions run only when a ``TransformerConfig`` fusion flag is on, and
:func:`tierstack.runtime.fusions.fusion_flags` turns every flag off without a GPU. One is called
anyway: ``megatron.core.transformer.utils.openai_gelu``, our ``model.activation_func=gelu_tanh``
(:func:`tierstack.models.gpt.activation_function`). Compiled on a CPU, its first call took 9.7 s (an
inductor C++ build, on every rank of every launch) and its result differed from eager torch by
about one ulp. So on a CPU, :func:`install_cpu_hook` arranges for megatron-core's own
``disable_jit_fuser()`` to run right after ``megatron.core.jit`` executes, before any module
decorates with it: the functions stay plain Python and run eagerly (``gelu_tanh`` is then exactly
eager torch's tanh-approximated GELU). On a GPU nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

JIT_MODULE = "megatron.core.jit"


class _DisableAfterExec(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` with its normal finder and calls its ``disable_jit_fuser()`` after it runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once; the normal finders locate it
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_disable(module):
            exec_module(module)
            disable = getattr(module, "disable_jit_fuser", None)
            if callable(disable):  # absent in some megatron-core version: keep its default
                disable()

        spec.loader.exec_module = exec_then_disable
        return spec


def install_cpu_hook() -> bool:
    """Have megatron-core's JIT fuser be a no-op decorator from its first import (call only without a GPU).

    Returns:
        True when the hook was installed; False when ``megatron.core.jit`` was already imported (its
        fusion modules may already be decorated; nothing is changed then) or the hook is in place.
    """
    if JIT_MODULE in sys.modules or any(isinstance(f, _DisableAfterExec) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _DisableAfterExec())
    return True
