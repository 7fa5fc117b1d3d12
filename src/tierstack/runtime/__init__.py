"""The one package that knows CPU from GPU: device, backend, process groups, RNG state.

Nothing else in tierstack calls ``torch.cuda``; it asks this package.
"""

from tierstack.runtime.host_copy import copy_to_host, empty_host_buffer
from tierstack.runtime.distributed import (
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
    "copy_to_host",
    "empty_host_buffer",
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
