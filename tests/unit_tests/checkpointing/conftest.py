"""Fixtures shared by the checkpointing unit tests."""

import pytest
import torch


@pytest.fixture
def gloo_group(tmp_path):
    """1-rank gloo group, with the CPU layer megatron-core's finalize needs on a CPU-only torch."""
    from tierstack.runtime import cpu_compat

    was_active = cpu_compat.is_active()
    cpu_compat.activate()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
    if not was_active:
        cpu_compat.deactivate()


@pytest.fixture
def memory(monkeypatch):
    """LOCAL steps held in host memory (``local_memory``) on, as under in-process restart; nothing held."""
    from tierstack.checkpointing import local_memory

    monkeypatch.setattr(local_memory, "_enabled", True)
    monkeypatch.setattr(local_memory, "_held", None)
    yield
    local_memory.forget()
