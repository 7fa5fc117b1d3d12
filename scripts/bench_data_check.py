"""Cost of the dataset check at setup (issue 15) on the main job's corpus, side by side.

Measures, on the stdlib corpus (~12 M byte tokens) in one run, single process:
- the whole check with the sidecar ``tierstack preprocess`` writes (no scan),
- the same files without a sidecar: the first check (memory-mapped scan of every token),
  and the next ones (the scan cache beside the dataset index cache),
- the page-cache-cold first scan (``posix_fadvise(DONTNEED)`` on the ``.bin`` first).

Run: ``.venv/bin/python scripts/bench_data_check.py [--reps 5] [--cache-dir DIR]``.
Each figure: median, min, max of the repetitions, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn, reps: int, before=None) -> list[float]:
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        problems, _ = fn()
        out.append((time.perf_counter() - t0) * 1e3)
        assert problems == [], problems
    return out


def main() -> None:
    from tierstack.data import checks
    from tierstack.data.preprocess import ensure_stdlib_corpus
    from tierstack.data.tokenizers import ByteTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache-dir", default=".cache/tierstack", help="where the stdlib corpus is (built if missing)")
    args = ap.parse_args()
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    prefix = ensure_stdlib_corpus(args.cache_dir, tok)
    print(f"corpus {prefix} ready in {time.perf_counter() - t0:.1f} s")
    if not checks.sidecar_path(prefix).is_file():  # a corpus cached by an older tierstack
        raise SystemExit(f"{checks.sidecar_path(prefix)} is missing: delete {Path(prefix).parent} to rebuild it")
    summary = checks.read_index(prefix)
    print(f"{summary.num_documents} documents, {summary.num_tokens:,} tokens, {summary.bin_bytes / 1e6:.1f} MB "
          f"({summary.dtype.name}); {args.reps} reps, milliseconds (median, min, max)")
    with tempfile.TemporaryDirectory() as tmp:
        bare = f"{tmp}/nosidecar"
        for ext in (".bin", ".idx"):
            shutil.copy(f"{prefix}{ext}", f"{bare}{ext}")
        scan_cache = f"{tmp}/cache"
        rows = {
            "with sidecar (no scan)": _timed(lambda: checks.check_prefix(prefix, tok, scan_cache), args.reps),
            "no sidecar, first check (scan, warm)": _timed(
                lambda: checks.check_prefix(bare, tok, scan_cache), args.reps,
                before=lambda: shutil.rmtree(scan_cache, ignore_errors=True)),
            "no sidecar, first check (scan, cold)": _timed(
                lambda: checks.check_prefix(bare, tok, scan_cache), args.reps,
                before=lambda: (shutil.rmtree(scan_cache, ignore_errors=True), _drop_cache(f"{bare}.bin"))),
            "no sidecar, later checks (scan cache)": _timed(lambda: checks.check_prefix(bare, tok, scan_cache),
                                                            args.reps),
        }
    base = statistics.median(rows["with sidecar (no scan)"])
    print(f"{'figure':40s} {'median':>8s} {'min':>8s} {'max':>8s} {'/sidecar':>9s}")
    for name, ms in rows.items():
        med = statistics.median(ms)
        print(f"{name:40s} {med:8.2f} {min(ms):8.2f} {max(ms):8.2f} {med / base:8.1f}x")


if __name__ == "__main__":
    main()
