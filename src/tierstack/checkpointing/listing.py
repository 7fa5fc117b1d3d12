"""``tierstack checkpoints ls|verify PATH``: what each checkpoint under PATH holds and whether it is whole.

PATH may be a GLOBAL root (``checkpoint.save``), one GLOBAL step directory, a LOCAL root
(``checkpoint.local_dir``), or a directory holding tier roots (a run directory such as
``runs/gpt_tiny``: each tier root found directly under it is reported). ``ls`` checks presence and sizes; ``verify`` also checks every checksum.
Both return ``(text, exit_status)``: 0 every published checkpoint is whole, 1 a published one is
damaged (files, or directory name, manifest and embedded TrainState disagree on the step), 2 nothing
found. Leftovers of interrupted saves and quarantined checkpoints are listed, never counted invalid.

GLOBAL rows show the best metric each checkpoint was recorded with (``checkpoint.keep_best_k``) and
mark the best (``best``) and the rest of the top-K (``top-k``) as the latest checkpoint's TrainState
records them. ``verify`` also checks that the trackers, those records and the directories agree:
the ``latest`` tracker names a valid checkpoint (whose TrainState holds the records), the ``best``
tracker names the best record, and every record names a valid checkpoint (status 1 otherwise).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional

from tierstack.checkpointing.replication import REPLICAS_DIR
from tierstack.checkpointing import local_file, best, manifest, paths

_HEADER = ("tier", "step", "size", "files", "valid", "consumed", "metric", "mark", "run", "path / problem")


def ls(path: str) -> tuple[str, int]:
    """Table of the checkpoints under ``path`` (sizes checked, not checksums); ``(text, status)``."""
    return _report_any(Path(path), checksums=False)


def verify(path: str) -> tuple[str, int]:
    """Like :func:`ls`, and every file's checksum is checked against its manifest."""
    return _report_any(Path(path), checksums=True)


def _is_tier_root(path: Path) -> bool:
    if (path / paths.MANIFEST).exists() or (path / paths.TRACKER_ITERATION).exists():
        return True
    return any(p.is_dir() and (p.name.isdigit() or p.name.startswith("iter_")) for p in path.iterdir())


def _report_any(path: Path, checksums: bool) -> tuple[str, int]:
    if not path.is_dir() or _is_tier_root(path):
        return _report(path, checksums)
    roots = sorted(p for p in path.iterdir() if p.is_dir() and _is_tier_root(p))
    if not roots:
        return f"{path}: no checkpoints", 2
    reports = [_report(r, checksums) for r in roots]
    return "\n\n".join(text for text, _ in reports), max(status for _, status in reports)


def _step_disagreement(d: Path, man: dict, step: int, deep: bool) -> Optional[str]:
    """Directory name, manifest and the TrainState inside the checkpoint must name one step."""
    ts_step = man.get("train_state", {}).get("step")
    if ts_step != step:
        return f"step-mismatch manifest train_state says {ts_step}"
    if deep and ((d / "common.pt").exists() or (d / ".metadata").exists()):  # the legacy or the 0.19 layout
        embedded, problem = _embedded_step(d)
        if problem is not None:
            return problem
        if embedded is not None and embedded != step:
            return f"step-mismatch embedded TrainState says {embedded}"
    return None


def _embedded_step(d: Path) -> tuple[Optional[int], Optional[str]]:
    """The step of the TrainState inside a GLOBAL checkpoint's common state, and a problem or None.

    Both layouts: megatron-core 0.19 keeps the common state as a ``common_state`` shard inside the
    torch_dist files; checkpoints of earlier releases (tierstack <= 0.x on megatron-core 0.16) have a
    ``common.pt``. megatron-core's ``load_common_state_dict`` reads either (``weights_only`` loads).
    """
    import logging as _logging

    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    quiet = _logging.getLogger("megatron.core.dist_checkpointing.strategies.common")
    level = quiet.level
    quiet.setLevel(_logging.ERROR)  # load_common's deprecation notice, once per legacy checkpoint
    from tierstack.checkpointing import safe_load

    unsafe = safe_load.problem(d, [".metadata", "common.pt"])
    if unsafe is not None:
        return None, unsafe  # read nothing more of it
    try:
        common = load_common_state_dict(str(d))
    except Exception as e:  # noqa: BLE001 - an unreadable file is a damaged checkpoint
        where = "common.pt" if (d / "common.pt").exists() else "common state"
        return None, f"unreadable {where} ({type(e).__name__})"
    finally:
        quiet.setLevel(level)
    return (common.get("train_state", {}) or {}).get("step") if isinstance(common, dict) else None, None


def _row(tier: str, step, size: int, nfiles: int, problem: Optional[str], man: Optional[dict], where: str,
         kind: Optional[str] = None, metric: str = "-", mark: str = "") -> tuple:
    """``kind`` marks what is not a published checkpoint (leftover, quarantined): never counted invalid.
    ``metric``/``mark``: the best metric recorded for the step, and ``best``/``top-k``."""
    ts = (man or {}).get("train_state", {})
    return (
        tier, str(step), _human(size), str(nfiles), kind or ("yes" if problem is None else "NO"),
        str(ts.get("consumed_train_samples", "-")), metric, mark, str((man or {}).get("run_id", "-")),
        where if problem is None else f"{where}: {problem}",
    )


def _global_dirs(root: Path) -> list[Path]:
    if (root / paths.MANIFEST).exists():
        return [root]
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_")),
                  key=lambda p: (paths.parse_step_dir(p.name.split(".")[0]) or -1, p.name))


def _global_rows(root: Path, checksums: bool) -> tuple[list[tuple], dict[int, dict]]:
    """The rows, and the manifests of the valid published checkpoints by step."""
    entries, valid = [], {}
    for d in _global_dirs(root):
        step = paths.parse_step_dir(d.name)
        man = paths.read_json(d / paths.MANIFEST)
        if step is None:  # leftover of an interrupted save, or quarantined: listed, not a checkpoint
            kind = "leftover" if paths.is_leftover(d.name) else paths.aside_kind(d.name) or "other"
            entries.append((d.name.split(".")[0][5:].lstrip("0") or "0", 0, 0, kind, man, d.name, kind))
            continue
        problem = manifest.check_manifest(man, step=step)
        if problem is None:
            problem = manifest.check_files(d, man["files"], checksums=checksums) or _step_disagreement(
                d, man, step, checksums)
        if problem is None:
            valid[step] = man
        files = (man or {}).get("files", {})
        entries.append((step, int((man or {}).get("bytes", 0)), len(files), problem, man, d.name, None))
    records, metric = _records(root, valid)
    top = {s: ("best" if i == 0 else "top-k") for i, (s, _) in enumerate(records)}
    rows = []
    for step, size, nfiles, problem, man, where, kind in entries:
        key = step if kind is None else None
        value = f"{metric[key]:.4f}" if key in metric else "-"
        rows.append(_row("global", step, size, nfiles, problem, man, where, kind, value, top.get(key, "")))
    return rows, valid


def _latest_step(root: Path, valid: dict[int, dict]) -> Optional[int]:
    """The step the ``latest`` tracker names when it is a valid checkpoint, else the newest valid one
    (a run resumed with ``ckpt_step`` leaves newer checkpoints beside the one it publishes)."""
    tracker = root / paths.TRACKER_ITERATION
    text = tracker.read_text().strip() if tracker.exists() else ""
    if text.isdigit() and int(text) in valid:
        return int(text)
    return max(valid) if valid else None


def _records(root: Path, valid: dict[int, dict]) -> tuple[list, dict[int, float]]:
    """The latest checkpoint's top-K records, and every step's recorded metric (any manifest)."""
    metric: dict[int, float] = {}
    for step in paths.sorted_steps(valid):
        for s, v in valid[step].get("train_state", {}).get("best_checkpoints") or []:
            metric[int(s)] = float(v)
    latest = _latest_step(root, valid)
    records = valid[latest].get("train_state", {}).get("best_checkpoints") or [] if latest is not None else []
    return [[int(s), float(v)] for s, v in records], metric


def _agreement(root: Path, valid: dict[int, dict]) -> list[str]:
    """Where the trackers, the latest TrainState's records and the directories disagree."""
    problems = []
    tracker = root / paths.TRACKER_ITERATION
    latest_text = tracker.read_text().strip() if tracker.exists() else None
    if latest_text is not None and not (latest_text.isdigit() and int(latest_text) in valid):
        problems.append(f"{paths.TRACKER_ITERATION} names {latest_text!r}, which is not a valid checkpoint here")
    records, _ = _records(root, valid)
    best_file = root / best.TRACKER_BEST
    best_text = best_file.read_text().strip() if best_file.exists() else None
    if records and best_text != str(records[0][0]):
        problems.append(f"{best.TRACKER_BEST} names {best_text}, the records' best is step {records[0][0]}")
    if best_text is not None and not records:
        problems.append(f"{best.TRACKER_BEST} names {best_text} but the latest checkpoint records no best")
    for s, _ in records:
        if s not in valid:
            problems.append(f"best record step {s} has no valid checkpoint directory")
    return problems


def _local_rows(root: Path, checksums: bool) -> list[tuple]:
    per_step: dict[int, list] = defaultdict(list)
    leftovers: list[Path] = []
    ranks = [int(d.name) for d in paths.rank_dirs(root)]
    for r in ranks:
        for f in (root / str(r)).iterdir():
            parsed = paths.parse_local_file(f.name)
            if parsed is None:
                if paths.is_leftover(f.name) or ".invalid-" in f.name:
                    leftovers.append(f)
                continue
            per_step[parsed[0]].append((r, *_check_local_file(f, parsed, checksums)))
    # a step whose .dirty file some rank left was never sealed on every rank: an interrupted save
    interrupted = {paths.parse_local_name(f.name) for f in leftovers if f.name.endswith(".dirty.pt")}
    interrupted_steps = {parsed[0] for parsed in interrupted if parsed}
    rows = []
    for step in paths.sorted_steps(per_step):
        entries = per_step[step]
        problems, man, size = _summarize(entries, "rank")
        where = f"{len(entries)} rank file{'s' if len(entries) != 1 else ''}"
        if len(entries) != len(ranks) and step in interrupted_steps and not problems:
            rows.append(_row("local", step, size, len(entries), None, man,
                             f"{where}: interrupted save, sealed on {len(entries)} of {len(ranks)} ranks", "leftover"))
            continue
        if len(entries) != len(ranks):
            problems.append(f"only {len(entries)} of {len(ranks)} ranks")
        rows.append(_row("local", step, size, len(entries), "; ".join(problems) or None, man, where))
    for f in leftovers:
        kind = paths.aside_kind(f.name) or "leftover"
        step = paths.parse_local_name(f.name)
        rows.append(_row("local", step[0] if step else "-", 0, 1, kind, None, f"{f.parent.name}/{f.name}", kind))
    return rows + _replica_rows(root / REPLICAS_DIR, checksums)


def _check_local_file(f: Path, parsed: tuple[int, int], checksums: bool) -> tuple[dict | None, str | None]:
    """The manifest of the LOCAL file ``f`` (step, rank = ``parsed``) and its problem (None when
    the manifest is sound and the file matches its recorded size and, with ``checksums``, checksum)."""
    man = paths.read_json(f.with_name(paths.local_manifest_name(*parsed)))
    problem = manifest.check_manifest(man, step=parsed[0])
    if problem is None:
        problem = manifest.check_files(f.parent, man["files"], checksums=checksums)
    if problem is None and checksums:  # verify: its pickled part must load weights-only
        try:
            local_file.check_pickle(f)
        except local_file.LocalFileError as e:
            problem = str(e)
    return man, problem


def _summarize(entries: list[tuple], label: str) -> tuple[list[str], dict | None, int]:
    """For one step's ``(rank, manifest, problem)`` entries: the problems (each prefixed
    ``"<label> <rank>: "``), one manifest to describe the step, and the bytes of all files."""
    problems = [f"{label} {r}: {p}" for r, _, p in entries if p is not None]
    man = next((m for _, m, _ in entries if m), None)
    return problems, man, sum(int(m.get("bytes", 0)) for _, m, _ in entries if m)


def _replica_rows(folder: Path, checksums: bool) -> list[tuple]:
    """One row per step of the replicas this node keeps for ranks on other nodes
    (``replicas/<owner>/``, ``checkpoint.replication_factor``): each file checked against its
    owner's manifest like an own file (a damaged one is listed invalid: resume would refuse it)."""
    if not folder.is_dir():
        return []
    per_step: dict[int, list] = defaultdict(list)
    rows = []
    for owner_dir in paths.rank_dirs(folder):
        for f in sorted(owner_dir.iterdir()):
            parsed = paths.parse_local_file(f.name)
            if parsed is None:
                if paths.is_leftover(f.name.lstrip(".")):
                    step = paths.parse_local_name(f.name)
                    rows.append(_row("local", step[0] if step else "-", 0, 1, "leftover", None,
                                     f"{REPLICAS_DIR}/{owner_dir.name}/{f.name}", "leftover"))
                continue
            per_step[parsed[0]].append((parsed[1], *_check_local_file(f, parsed, checksums)))
    for step in paths.sorted_steps(per_step):
        entries = per_step[step]
        problems, man, size = _summarize(entries, "replica of rank")
        where = f"replica(s) of rank(s) {[o for o, _, _ in entries]}"
        rows.append(_row("local", step, size, len(entries), "; ".join(problems) or None, man, where,
                         None if problems else "replica"))
    return rows


def _report(path: Path, checksums: bool) -> tuple[str, int]:
    if not path.is_dir():
        return f"{path}: not a directory", 2
    is_local = any(p.is_dir() and p.name.isdigit() for p in path.iterdir())
    disagree: list[str] = []
    if is_local:
        rows = _local_rows(path, checksums)
    else:
        rows, valid = _global_rows(path, checksums)
        if checksums and not (path / paths.MANIFEST).exists():  # a tier root, not one step directory
            disagree = _agreement(path, valid)
    if not rows:
        return f"{path}: no checkpoints", 2
    lines = [f"{path} ({'LOCAL' if is_local else 'GLOBAL'} tier)"]
    tracker = path / paths.TRACKER_ITERATION
    if tracker.exists():
        lines.append(f"tracker: latest step {tracker.read_text().strip()}")
    if (path / best.TRACKER_BEST).exists():
        lines.append(f"tracker: best step {(path / best.TRACKER_BEST).read_text().strip()} (metric: lower is better)")
    run = paths.read_run_file(path)
    if run:
        lines.append(f"run family: {run['run_id']}")
    table = [_HEADER] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(_HEADER) - 1)]
    for r in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    bad = sum(1 for r in rows if r[4] == "NO")
    replicas = sum(1 for r in rows if r[4] == "replica")
    others = len(rows) - replicas - sum(1 for r in rows if r[4] in ("yes", "NO"))
    lines.append(f"{len(rows) - others - replicas} checkpoint(s), {bad} invalid"
                 + (f"; {replicas} step(s) of valid replicas kept for other nodes" if replicas else "")
                 + (f"; {others} leftover/quarantined/rewound (not checkpoints; the next save cleans leftovers)" if others else "")
                 + ("" if checksums else " (sizes only; `verify` checks checksums)"))
    lines += [f"DISAGREE: {p}" for p in disagree]
    return "\n".join(lines), (1 if bad or disagree else 0)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"
