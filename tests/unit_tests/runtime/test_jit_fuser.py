"""On a CPU, megatron-core's JIT fuser is its own no-op decorator from its first import, so a rank
never imports torch's compiler backend (inductor's compile_fx); the model still builds and runs."""

import subprocess
import sys
import textwrap

import pytest

from tierstack.runtime import has_gpu

PROBE = textwrap.dedent(
    """
    import sys
    {first}
    import torch
    from megatron.core.fusions import fused_bias_gelu
    import megatron.core.jit as jit
    print("noop" if jit.jit_fuser is jit.noop_decorator else "compile")
    print("compile_fx" if "torch._inductor.compile_fx" in sys.modules else "no compile_fx")
    if jit.jit_fuser is not jit.noop_decorator:
        raise SystemExit(0)  # compiled: calling it on a CPU would start an inductor build
    # The decorated function is the plain Python one, and computes what it should.
    x, b = torch.randn(3, 4), torch.randn(4)
    y = fused_bias_gelu.bias_gelu(b, x)
    print("plain" if type(fused_bias_gelu.bias_gelu).__name__ == "function" else type(fused_bias_gelu.bias_gelu).__name__)
    print(bool(torch.allclose(y, torch.nn.functional.gelu(x + b, approximate="tanh"), atol=1e-3)))
    """
)


def _probe(first: str) -> list[str]:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(first=first)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.skipif(has_gpu(), reason="the hook is installed only without a GPU")
def test_tierstack_first_keeps_the_fuser_plain():
    assert _probe("import tierstack") == ["noop", "no", "compile_fx", "plain", "True"]


@pytest.mark.skipif(has_gpu(), reason="the hook is installed only without a GPU")
def test_megatron_first_is_left_as_megatron_made_it():
    # Imported before tierstack: the hook does not touch an already-decorated module (and says so).
    out = _probe("import megatron.core.jit\nimport tierstack\nfrom tierstack.runtime import jit_fuser\n"
                 "assert jit_fuser.install_cpu_hook() is False")
    assert out == ["compile", "compile_fx"]
