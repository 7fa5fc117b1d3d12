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

From megatron-core 0.17 one module bypasses ``jit_fuser``: ``megatron/core/transformer/moe/router.py``
decorates a method with a bare ``@torch.compile`` when its class is defined, and
``megatron.core.models.gpt`` imports it, so every rank imported torch's compiler stack again
(``torch._inductor.compile_fx``; measured 5.6 s vs 4.4 s for ``import tierstack,
megatron.core.models.gpt`` on this machine, megatron-core 0.19.2). The method is MoE routing, never
called by tierstack's dense models; compiled or not it computes the same. On a CPU, while that one
module executes, ``torch.compile`` used as a bare decorator returns the function as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

JIT_MODULE = "megatron.core.jit"
ROUTER_MODULE = "megatron.core.transformer.moe.router"


def _disable_jit_fuser(module) -> None:
    disable = getattr(module, "disable_jit_fuser", None)
    if callable(disable):  # absent in some megatron-core version: keep its default
        disable()


def _exec_without_bare_compile(exec_module, module) -> None:
    """Run ``exec_module(module)`` with ``torch.compile(fn)`` (no options) returning ``fn`` itself."""
    import torch

    real = torch.compile

    def plain_compile(model=None, **kwargs):
        if callable(model) and not kwargs:
            return model  # the decorator form: leave the function eager (CPU only)
        return real(model, **kwargs) if model is not None else real(**kwargs)

    torch.compile = plain_compile
    try:
        exec_module(module)
    finally:
        torch.compile = real


class _DisableAfterExec(importlib.abc.MetaPathFinder):
    """Finds megatron-core's JIT module and its MoE router with their normal finders, and runs them
    without loading torch's compiler: ``disable_jit_fuser()`` right after ``megatron.core.jit``
    executes; ``torch.compile`` as a bare decorator is the identity while the router executes."""

    def __init__(self) -> None:
        self.pending = {JIT_MODULE, ROUTER_MODULE}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        sys.meta_path.remove(self)  # each module once; the normal finders locate it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        if fullname == JIT_MODULE:
            def patched(module):
                exec_module(module)
                _disable_jit_fuser(module)
        else:
            def patched(module):
                _exec_without_bare_compile(exec_module, module)
        spec.loader.exec_module = patched
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
