"""Preflight's local check: any NaN or inf in a parameter or gradient (``main_grad`` first) fails it."""

import pytest
import torch

from tierstack.checkpointing.preflight import _local_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["param", "grad", "main_grad"])
def test_one_non_finite_value_anywhere_fails(bad, where):
    m = torch.nn.Linear(4, 3)
    m.weight.grad = torch.zeros(3, 4)
    assert _local_finite([m])
    target = {"param": m.weight.data, "grad": m.weight.grad, "main_grad": None}[where]
    if where == "main_grad":
        m.weight.main_grad = torch.zeros(3, 4)  # megatron DDP's buffer takes precedence over .grad
        target = m.weight.main_grad
    target[1, 2] = bad
    assert not _local_finite([m])


def test_huge_but_finite_values_pass_and_empty_tensors_are_fine():
    m = torch.nn.Linear(4, 3)
    m.weight.data.fill_(3e38)  # a sum would overflow to inf; the check must not
    m.bias.grad = torch.zeros(3)
    assert _local_finite([m, torch.nn.Linear(0, 0)])
