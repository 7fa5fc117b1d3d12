"""Names on disk and atomic file writes.

GLOBAL root (``checkpoint.save``)::

    run.json                              run family (see below)
    latest_checkpointed_iteration.txt     tracker: newest published step
    latest_train_state.pt                 tracker: its TrainState
    iter_0000020/                         one published checkpoint (torch_dist files, manifest.json,
                                          run_config.yaml)
    iter_0000030.staging-<run>-<n>/       an attempt in progress or failed; never read
    iter_0000010.invalid-<reason>/        quarantined by resume selection; never read, never deleted

LOCAL root (``checkpoint.local_dir``), one folder per global rank (the NVRx layout)::

    run.json
    <rank>/iter_0000020_<rank>_local.pt            NVRx file (written as .dirty, then renamed)
    <rank>/iter_0000020_<rank>_local.manifest.json our manifest, written after the file

Run family: ``run.json`` in a tier root names the run (``run_id``) whose checkpoints live there. It
is written when a run starts fresh and at every publish where it differs. Which family a launch
continues is decided by :mod:`tierstack.checkpointing.family` (the GLOBAL record first; a LOCAL
record only without a GLOBAL directory; checkpoints with no record are not adopted); checkpoints
whose manifest names another run are not candidates, not retained, not deleted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from tierstack.config.pretrained_spec import TRACKER_ITERATION, step_dir_name  # noqa: F401 - the one definition, re-exported

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
TRACKER_TRAIN_STATE = "latest_train_state.pt"
MANIFEST = "manifest.json"
RUN_CONFIG = "run_config.yaml"
FORMAT_VERSION = 2  # 2: CRC-32C checksums, LOCAL files in the tierstack local format (local_file.py)
READABLE_FORMAT_VERSIONS = (1, 2)  # 1: CRC-32 checksums, LOCAL files written by NVRx torch.save

_GLOBAL_DIR = re.compile(r"^iter_(\d+)$")
_LOCAL_FILE = re.compile(r"^iter_(\d+)_(\d+)_local\.pt$")
_LOCAL_STEM = re.compile(r"^iter_(\d+)_(\d+)_local(?:\.|$)")




def parse_step_dir(name: str) -> Optional[int]:
    """Step of a published GLOBAL directory name; None for staging, quarantined or foreign names."""
    m = _GLOBAL_DIR.match(name)
    return int(m.group(1)) if m else None


def staging_dir_name(step: int, run_id: str, attempt: int) -> str:
    return f"{step_dir_name(step)}.staging-{run_id}-{attempt}"


def deleting_dir_name(step: int, run_id: str) -> str:
    """What retention renames a GLOBAL step directory of run ``run_id`` to before deleting it."""
    return f"{step_dir_name(step)}.deleting-{run_id}"


def is_leftover(name: str) -> bool:
    """Whether ``name`` in a tier root or rank folder is left by an interrupted save or deletion: a
    GLOBAL staging directory, a GLOBAL directory retention was deleting, a LOCAL ``.dirty`` file,
    or a temp file of an atomic write."""
    return ".staging-" in name or ".deleting-" in name or name.endswith(".dirty.pt") or ".tmp-" in name


def remove_leftovers(folder: Path, run_id: str) -> list[Path]:
    """Remove what interrupted saves left in ``folder`` (a GLOBAL root or a LOCAL rank folder):
    staging directories of run ``run_id`` and its directories retention was deleting, ``.dirty``
    files, temp files of atomic writes made by other processes. Another run's staging directories
    are left alone (they may be that run's save in progress; ``checkpoints verify`` lists them as
    leftovers). A removal that fails is logged.

    Returns:
        The paths removed.
    """
    import shutil

    removed = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        name = p.name
        if not is_leftover(name) or name.endswith(f".tmp-{os.getpid()}"):
            continue
        if (".staging-" in name and f".staging-{run_id}-" not in name) or (
                ".deleting-" in name and not name.endswith(f".deleting-{run_id}")):
            continue
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove %s, left by an interrupted save: %s", p, e)
            continue
        log.info("removed %s, left by an interrupted save or deletion", p)
        removed.append(p)
    return removed


def local_file_name(step: int, rank: int) -> str:
    return f"iter_{step:07d}_{rank}_local.pt"


def local_manifest_name(step: int, rank: int) -> str:
    return f"iter_{step:07d}_{rank}_local.manifest.json"


def parse_local_file(name: str) -> Optional[tuple[int, int]]:
    """``(step, rank)`` of a published LOCAL file name; None for ``.dirty``/quarantined/others."""
    m = _LOCAL_FILE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_local_name(name: str) -> Optional[tuple[int, int]]:
    """``(step, rank)`` of any name made from a LOCAL file's: the file, its manifest, and their
    ``.dirty``, temp (``<name>.tmp-*``) and quarantined (``<name>.invalid-*``) forms; None for
    others (a temp file's leading dot is the caller's to strip)."""
    m = _LOCAL_STEM.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def rank_dirs(folder: Path) -> list[Path]:
    """The sub-folders of ``folder`` named by a rank (LOCAL rank folders, ``replicas/<owner>``),
    in rank order; none when ``folder`` does not exist."""
    if not folder.is_dir():
        return []
    return sorted((d for d in folder.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))


def sorted_steps(steps) -> list[int]:
    """Numeric order (999 before 1000), never the lexical order of directory names."""
    return sorted(int(s) for s in steps)


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> list[Path]:
    """Make every file under ``root`` and every directory of it (``root`` included) durable: each
    file is opened and fsync'd (cheap for a file its writer already fsync'd), then each directory,
    deepest first. Returns the files fsync'd.

    Raises:
        OSError: a file could not be opened or fsync'd (the caller's save then fails, retried when
            transient); a directory that refuses fsync is tolerated as in :func:`fsync_dir`.
    """
    files = sorted(p for p in Path(root).rglob("*") if p.is_file())
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = sorted((p for p in Path(root).rglob("*") if p.is_dir()), key=lambda d: len(d.parts), reverse=True)
    for d in [*dirs, Path(root)]:
        fsync_dir(d)
    return files


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file beside ``path``, fsync, rename over ``path``, fsync the directory.

    A reader sees the old content or the new, never a torn file.
    """
    commit_atomic(prepare_atomic(path, data), path)


def prepare_atomic(path: Path, data: bytes) -> Path:
    """First half of :func:`atomic_write_bytes`: the data, fsync'd in a temp file beside ``path``.

    Everything that can run out of space happens here; :func:`commit_atomic` only renames.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def commit_atomic(tmp: Path, path: Path) -> None:
    """Second half of :func:`atomic_write_bytes`: rename ``tmp`` over ``path``, fsync the directory.

    Raises:
        OSError: the rename failed (``path`` is a directory, the folder became read-only, ...); the
            temp file is removed first, so a failed write leaves nothing beside ``path``.
    """
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(Path(path).parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Optional[dict]:
    """Parsed JSON object, or None when missing or unreadable."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_run_file(root: Optional[Path]) -> Optional[dict]:
    """``{"run_id", "written_unix"}`` of a tier root, or None."""
    if root is None:
        return None
    info = read_json(Path(root) / RUN_FILE)
    if info is None or not isinstance(info.get("run_id"), str):
        return None
    return info


def write_run_file(root: Path, run_id: str) -> None:
    """Record ``run_id`` as the family of ``root`` (no-op when already so)."""
    root = Path(root)
    current = read_run_file(root)
    if current is not None and current["run_id"] == run_id:
        return
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(root / RUN_FILE, {"run_id": run_id, "written_unix": time.time()})


def quarantine(path: Path, reason: str, kind: str = "invalid") -> Path:
    """Rename ``path`` out of the candidate namespace (``<name>.<kind>-<reason>``); never deletes.
    ``kind`` "invalid": quarantined (a budget of them is kept, retention removes the oldest);
    "rewound": the abandoned timeline of a rewind (``checkpoint.ckpt_step``), never removed by us."""
    path = Path(path)
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", reason)[:40].strip("-") or "unknown"
    target = path.with_name(f"{path.name}.{kind}-{slug}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{kind}-{slug}-{n}")
    os.rename(path, target)
    return target


def aside_kind(name: str) -> Optional[str]:
    """"quarantined", "rewound" (see :func:`quarantine`) or None for a name not moved aside."""
    return "quarantined" if ".invalid-" in name else "rewound" if ".rewound-" in name else None


def interrupted_local_steps(rank_dir: Path, rank: int) -> list[int]:
    """Steps of ``rank`` whose LOCAL write was left unfinished in ``rank_dir`` (a ``.dirty`` file)."""
    if not rank_dir.is_dir():
        return []
    out = []
    for p in rank_dir.iterdir():
        if p.name.endswith(".dirty.pt"):
            parsed = parse_local_file(p.name[: -len(".dirty.pt")] + ".pt")
            if parsed is not None and parsed[1] == rank:
                out.append(parsed[0])
    return out
