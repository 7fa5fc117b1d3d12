"""The one package that knows CPU from GPU: device, backend, process groups, RNG state.

Nothing else in tierstack calls ``torch.cuda``; it asks this package.
"""

from tierstack.platform.runtime import (
    ParallelLayout,
    current_layout,
    default_backend,
    destroy_distributed,
    device,
    get_rng_state,
    has_gpu,
    initialize_distributed,
    memory_allocated_bytes,
    seed_all,
    set_rng_state,
    synchronize,
)

__all__ = [
    "ParallelLayout",
    "current_layout",
    "default_backend",
    "destroy_distributed",
    "device",
    "get_rng_state",
    "has_gpu",
    "initialize_distributed",
    "memory_allocated_bytes",
    "seed_all",
    "set_rng_state",
    "synchronize",
]
