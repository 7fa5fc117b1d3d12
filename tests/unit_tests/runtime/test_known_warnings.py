"""The quiet start filters exactly the warnings it names: by message and by module, nothing else."""

import warnings

import pytest

from tierstack.runtime import known_warnings


def _shown(message, category, module):
    """Whether ``message`` issued from ``module`` reaches the user once the filters are installed."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        known_warnings.install_import_filters()
        known_warnings.install_cpu_filters()
        warnings.warn_explicit(message, category, "x.py", 1, module=module, registry={})
    return bool(seen)


@pytest.mark.parametrize("message,module", [
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", "megatron.core.optimizer"),
    ("Transformer Engine and Apex are not installed. Falling back to local implementations of "
     "multi_tensor_applier and multi_tensor_scale", "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
    ("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
    ("When using async grad allreduce it is recommended to set the environment variable "
     "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", "megatron.core.tensor_parallel.layers"),
])
def test_megatron_cpu_notices_are_filtered(message, module):
    assert not _shown(message, UserWarning, module)


NVRX_REPLICATION = "nvidia_resiliency_ext.checkpointing.local.replication._torch_future"


@pytest.mark.parametrize("message", [
    "`_get_pg_default_device` will be deprecated, it only stays for backward-compatibility reason. ",
    "Multiple backends are registered with this ProcessGroup. We cannot determine which one is the default. "
    "Returning cpu. Please consider using other APIs.",
])
def test_nvrx_replication_deprecation_notices_are_filtered_there_only(message):
    assert not _shown(message, UserWarning, NVRX_REPLICATION)
    assert _shown(message, UserWarning, "my_package.collectives")


def test_pynvml_notice_of_torch_cuda_is_filtered():
    assert not _shown("The pynvml package is deprecated. Please install nvidia-ml-py instead.", FutureWarning, "torch.cuda")


@pytest.mark.parametrize("message,module", [
    ("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
     "megatron.core.dist_checkpointing.strategies.torch"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", "tierstack.runtime.cpu_compat"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", "megatron.core.dist_checkpointing.mapping"),
])
def test_torch_deprecations_of_megatrons_resharding_load_are_filtered_there_only(message, module):
    assert not _shown(message, FutureWarning, module)
    assert _shown(message, FutureWarning, "my_package.checkpoint")


@pytest.mark.parametrize("message,category,module", [
    # another message from a filtered module
    ("Apex is not installed. Falling back to Torch Norm, and something else", UserWarning, "megatron.core.models.backends"),
    ("some deprecation in the optimizer", UserWarning, "megatron.core.optimizer"),
    # the same message from code that is not megatron-core / torch.cuda
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning, "my_package"),
    ("The pynvml package is deprecated.", FutureWarning, "my_package.cuda"),
    # the same message with another category
    ("Apex is not installed. Falling back to Torch Norm", DeprecationWarning, "megatron.core.models.backends"),
])
def test_every_other_warning_stays_visible(message, category, module):
    assert _shown(message, category, module)


def test_absent_gpu_packages_are_named_without_importing_them():
    absent = known_warnings.absent_gpu_packages()
    assert set(absent) <= set(known_warnings.GPU_PACKAGES)
