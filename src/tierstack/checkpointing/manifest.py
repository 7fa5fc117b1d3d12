"""Manifests: what a checkpoint holds and how to tell it is whole.

A manifest lists every file of a checkpoint with its size and CRC-32 (streamed, so a multi-GB shard
never sits in memory), the TrainState, run id, topology and format version. Resume selection and
``tierstack checkpoints verify`` both check a checkpoint against it.
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Iterable, Optional

from tierstack.checkpointing import layout

_CHUNK = 8 << 20


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(root: Path, names: Iterable[str]) -> dict[str, dict]:
    """``{relative name: {"size": bytes, "crc32": int}}`` for ``names`` under ``root``."""
    root = Path(root)
    return {n: {"size": (root / n).stat().st_size, "crc32": crc32_file(root / n)} for n in sorted(names)}


def list_files(root: Path, exclude: Iterable[str] = (layout.MANIFEST,)) -> list[str]:
    """Every regular file under ``root``, relative, excluding ``exclude``."""
    root = Path(root)
    skip = set(exclude)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in skip)


def build_manifest(
    *,
    tier: str,
    step: int,
    run_id: str,
    topology: dict,
    train_state: dict,
    files: dict[str, dict],
    **extra,
) -> dict:
    return {
        "format_version": layout.FORMAT_VERSION,
        "tier": tier,
        "step": int(step),
        "run_id": run_id,
        "topology": dict(topology),
        "train_state": dict(train_state),
        "files": files,
        "bytes": sum(int(f["size"]) for f in files.values()),
        "written_unix": time.time(),
        **extra,
    }


def write_manifest(path: Path, manifest: dict) -> None:
    """Seal: the manifest is written to a temp file, fsync'd and renamed into place."""
    layout.atomic_write_json(Path(path), manifest)


def check_files(root: Path, files: dict[str, dict], names: Optional[Iterable[str]] = None,
                checksums: bool = True) -> Optional[str]:
    """First problem found with the listed files (missing, size, checksum), or None when whole.

    Args:
        names: subset of ``files`` to check (ranks split the work of a big checkpoint); all if None.
        checksums: False checks presence and sizes only.
    """
    root = Path(root)
    for name in (sorted(files) if names is None else names):
        want = files[name]
        p = root / name
        try:
            size = p.stat().st_size
        except OSError:
            return f"missing-file {name}"
        if size != int(want["size"]):
            return f"size-mismatch {name} ({size} != {want['size']} bytes)"
        if checksums and crc32_file(p) != int(want["crc32"]):
            return f"checksum-mismatch {name}"
    return None


def check_manifest(manifest: Optional[dict], *, step: Optional[int] = None,
                   run_id: Optional[str] = None, topology: Optional[dict] = None) -> Optional[str]:
    """Problem with a manifest's header (not its files), or None."""
    if manifest is None:
        return "no-manifest"
    if manifest.get("format_version") != layout.FORMAT_VERSION:
        return f"format-version {manifest.get('format_version')}"
    for key in ("step", "run_id", "files", "train_state", "topology"):
        if key not in manifest:
            return f"manifest-lacks {key}"
    if step is not None and manifest["step"] != step:
        return f"step-mismatch manifest says {manifest['step']}"
    if run_id is not None and manifest["run_id"] != run_id:
        return "other-run"
    if topology is not None and manifest["topology"] != topology:
        return "topology-changed"
    return None
