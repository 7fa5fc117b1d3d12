"""The CPU compatibility layer's device-rewriting mode, on real torch calls."""

import pytest
import torch

from tierstack import runtime
from tierstack.runtime.cpu_compat import CudaToCpuMode

pytestmark = pytest.mark.skipif(runtime.has_gpu(), reason="the CPU layer is never used where CUDA exists")


def test_cuda_devices_become_the_cpu_inside_the_mode():
    with CudaToCpuMode():
        a = torch.zeros(3, device="cuda")
        b = torch.ones(2, device=torch.device("cuda", 0))
        c = torch.empty(4, device=0)  # megatron passes torch.cuda.current_device()
        d = torch.arange(3).cuda()
        e = torch.arange(3).to("cuda")
        assert torch.arange(2, dtype=torch.float32).type() == "torch.cuda.FloatTensor"
        assert torch.arange(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert all(t.device.type == "cpu" for t in (a, b, c, d, e))
    assert torch.equal(e, torch.arange(3))


def test_outside_the_mode_cuda_still_fails_loudly():
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
