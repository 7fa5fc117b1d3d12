"""Reading a checkpoint never runs code it contains.

A CRC is not an authentication: whoever hands over a checkpoint directory writes its manifests too.
So every pickle tierstack (or a library on its behalf) reads from a checkpoint is first limited to the
plain types that checkpoint needs:

- LOCAL files: their state dict is loaded with ``torch.load(weights_only=True)`` and an allow-list of
  the megatron-core classes of a hollow ``MCoreTensorAwareStateDict`` and numpy's RNG state types
  (:data:`LOCAL_GLOBALS`; the list was read off real files of this release and of the previous one).
- GLOBAL checkpoints: megatron-core reads ``common.pt`` (legacy layout) and the ``common_state`` shard
  with ``weights_only`` loads itself; torch's ``FileSystemReader.read_metadata`` reads ``.metadata``
  with a plain ``pickle.load``, so :func:`check_torch_dist_metadata` unpickles it first with an
  unpickler that resolves only torch.distributed.checkpoint's metadata classes, torch sizes, dtypes
  and layouts, and a few builtins (:data:`METADATA_MODULES`).

A file that needs anything else is refused as unreadable (:class:`UnsafeCheckpointError`, naming the
file and the global it asked for), before anything from it is used.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks, while it is read, for a Python global outside the allow-list."""


def _asked_for(e: BaseException) -> str:
    """The global named in torch's weights-only refusal, or its first line."""
    m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e)) or re.search(r"(\S+) was not an allowed global", str(e))
    return m.group(1) if m else str(e).splitlines()[0][:200]


def _refused(path: Path, e: BaseException) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"refused to load {path}: it asks for {_asked_for(e)}, which is outside the "
                                 "allow-list of what a checkpoint needs (nothing of it was run)")


def _local_globals() -> list:
    import numpy
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    return [MCoreTensorAwareStateDict, ShardedTensor, ShardedObject, LocalNonpersistentObject,
            numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32)), numpy._core.multiarray._reconstruct]


def load_local(blob: memoryview, path: Path) -> Any:
    """``torch.load(weights_only=True)`` of a LOCAL file's pickled part, with :func:`_local_globals`.

    Raises:
        UnsafeCheckpointError: the pickle asks for another global (names ``path`` and the global).
    """
    try:
        with torch.serialization.safe_globals(_local_globals()):
            return torch.load(io.BytesIO(blob), weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None


METADATA_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_TORCH_NAMES = {"Size", "device"}
_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "slice", "complex", "bytearray", "getattr"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(METADATA_MODULES) or module in ("collections",) and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)
                                  or name in ("strided", "sparse_coo", "contiguous_format", "preserve_format")):
            return super().find_class(module, name)
        if module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)
        if module == "builtins" and name in _BUILTINS - {"getattr"}:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"global {module}.{name}")


def check_torch_dist_metadata(step_dir: Path) -> None:
    """Unpickle ``step_dir/.metadata`` with the allow-list unpickler (a no-op without the file).

    Raises:
        UnsafeCheckpointError: the file asks for another global (names the file and the global).
    """
    path = Path(step_dir) / ".metadata"
    if not path.is_file():
        return
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"refused to load {path}: it asks for {str(e).removeprefix('global ')}, which "
                                    "torch_dist metadata never needs (nothing of it was run)") from None


def check_common_pt(step_dir: Path) -> None:
    """A legacy ``common.pt`` loads weights-only with megatron-core's own allow-list (a no-op without it).

    Raises:
        UnsafeCheckpointError: it asks for another global (names the file).
    """
    path = Path(step_dir) / "common.pt"
    if not path.is_file():
        return
    from megatron.core.safe_globals import SAFE_GLOBALS

    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None


def problem(step_dir: Path, names) -> "str | None":
    """``unsafe-pickle <file> (...)`` for the first pickled file among ``names`` of a GLOBAL step
    directory that asks for a global outside the allow-lists, else None."""
    for name, check in ((".metadata", check_torch_dist_metadata), ("common.pt", check_common_pt)):
        if name in names:
            try:
                check(step_dir)
            except UnsafeCheckpointError as e:
                return f"unsafe-pickle {name}: {e}"
    return None


def check_global(step_dir: Path) -> None:
    """Both pickled files of a GLOBAL step directory (see :func:`problem`).

    Raises:
        UnsafeCheckpointError: one of them asks for a global outside the allow-lists.
    """
    check_torch_dist_metadata(step_dir)
    check_common_pt(step_dir)
