"""Text and JSONL files -> a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

Also the built-in corpus: the ``.py`` sources of the running interpreter's standard library,
tokenized once and cached under ``dataset.cache_dir``.

The ``tierstack preprocess`` command calls :func:`preprocess` (the CLI wiring lives in ``cli.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from tierstack.data.checks import sidecar_path, write_sidecar
from tierstack.data.documents import JSONL_SUFFIXES, encoded  # noqa: F401 - JSONL_SUFFIXES re-exported

logger = logging.getLogger(__name__)

# Directories left out of the built-in corpus: test suites are ~60% of the stdlib's bytes, are
# repetitive, and include files with deliberately broken encodings.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_CORPUS_FORMAT_VERSION = 1  # bump when the way the corpus is built changes, to invalidate caches
STAMP_NAME = "stamp.json"


@dataclass(frozen=True)
class PreprocessStats:
    """What :func:`preprocess` wrote.

    Attributes:
        num_files: input files read.
        num_documents: documents written (one per text file, one per JSONL record).
        num_skipped_empty: documents with no tokens and no end token, left out.
        num_tokens: token ids written, end tokens included.
        bytes_read: input size in bytes.
        dtype: numpy dtype name of the ids in the .bin file (``uint16`` or ``int32``).
        max_token_id: largest id written (-1 when nothing was written).
        bin_path, idx_path: the files written.
        sidecar_path: ``<prefix>.meta.json``, what :mod:`tierstack.data.checks` reads at setup.
        seconds: wall time.
    """

    num_files: int
    num_documents: int
    num_skipped_empty: int
    num_tokens: int
    bytes_read: int
    dtype: str
    max_token_id: int
    bin_path: str
    idx_path: str
    sidecar_path: str
    seconds: float


def preprocess(
    inputs: Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer,
    append_eod: bool = True,
    *,
    json_key: str = "text",
    workers: int = 1,
) -> PreprocessStats:
    """Tokenize files into ``<output_prefix>.bin`` / ``.idx`` (megatron-core ``IndexedDataset``).

    Args:
        inputs: plain text files (one document each) and ``.jsonl`` files (one document per line,
            its ``json_key`` string; blank lines are skipped), read in the order given.
        output_prefix: path without extension; parent directories are created.
        tokenizer: anything with ``tokenize(str) -> list[int]``, ``eod`` and ``vocab_size``
            (picklable when ``workers > 1``).
        append_eod: end every document with ``tokenizer.eod`` (GPT-style document separation).
        json_key: the JSONL field that holds the text.
        workers: processes that tokenize (a :class:`multiprocessing.Pool`); the files written are
            the same, byte for byte, for any number.

    Each document is one sequence and one document of the indexed dataset. Ids are stored as
    ``uint16`` when the vocabulary has fewer than 65500 ids, else ``int32`` (megatron-core's
    ``DType.optimal_dtype``). Empty documents without an end token are skipped.

    The files are written under temporary names and renamed at the end, so an error leaves no
    ``.bin``/``.idx`` behind (and does not touch files already at the prefix). A sidecar
    ``<prefix>.meta.json`` (tokenizer identity, max token id, counts) is written last; setup checks it
    against the run's tokenizer (:mod:`tierstack.data.checks`).

    Returns:
        PreprocessStats.

    Raises:
        FileNotFoundError: an input is missing.
        ValueError: a bad JSONL line (file and 1-based line number named), no inputs, ``workers < 1``,
            or ids outside the vocabulary.
    """
    return _write(inputs, {json_key: Path(output_prefix)}, tokenizer, append_eod, workers)[json_key]


def json_key_prefix(output_prefix: str | Path, key: str) -> Path:
    """``<output_prefix>_<key>_document``: where :func:`preprocess_json_keys` writes ``key``'s dataset
    (Megatron-LM's ``preprocess_data.py`` name for it)."""
    return Path(f"{output_prefix}_{key}_document")


def preprocess_json_keys(
    inputs: Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer,
    json_keys: Sequence[str],
    append_eod: bool = True,
    *,
    workers: int = 1,
) -> dict[str, PreprocessStats]:
    """Like :func:`preprocess`, one dataset per JSONL key, each read from the same records:
    ``<output_prefix>_<key>_document.bin/.idx`` (:func:`json_key_prefix`), with its own sidecar.
    Every input must be ``.jsonl`` and every record must hold a string under every key.

    Returns:
        The stats of each key's dataset, by key.

    Raises:
        ValueError: as :func:`preprocess`; a record without one of the keys (file, line and key
            named); no key or a key named twice; a plain text input.
    """
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ValueError(f"--json-keys {' '.join(json_keys)}: give one or more different keys")
    return _write(inputs, {k: json_key_prefix(output_prefix, k) for k in json_keys}, tokenizer, append_eod, workers)


def _write(inputs, prefixes: dict[str, Path], tokenizer, append_eod: bool, workers: int) -> dict[str, PreprocessStats]:
    """Tokenize ``inputs`` into one dataset per key of ``prefixes``; temporary names until the end."""
    t0 = time.perf_counter()
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("preprocess needs at least one input file")
    if workers < 1:
        raise ValueError(f"--workers={workers}: give a number >= 1")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"preprocess input {str(p)!r} is not a file")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    out: dict[str, dict] = {}
    keys = list(prefixes)
    try:
        for key, prefix in prefixes.items():
            prefix.parent.mkdir(parents=True, exist_ok=True)
            out[key] = {"prefix": prefix, "tmp_bin": f"{prefix}.bin{tag}", "tmp_idx": f"{prefix}.idx{tag}",
                        "docs": 0, "skipped": 0, "tokens": 0, "max_id": -1}
            out[key]["builder"] = IndexedDatasetBuilder(out[key]["tmp_bin"], dtype=dtype)
        for ids_per_key in encoded(paths, keys, tokenizer, append_eod, workers):
            for key, ids in zip(keys, ids_per_key):
                _add(out[key], ids)
        for o in out.values():
            o["builder"].finalize(o["tmp_idx"])
        stats = {key: _publish(o, tokenizer, np.dtype(dtype).name) for key, o in out.items()}
    finally:
        for o in out.values():
            if "builder" in o:
                o["builder"].data_file.close()
            for leftover in (o["tmp_bin"], o["tmp_idx"]):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    seconds, bytes_read = time.perf_counter() - t0, sum(p.stat().st_size for p in paths)
    return {key: PreprocessStats(num_files=len(paths), bytes_read=bytes_read, seconds=seconds, **st)
            for key, st in stats.items()}


def _add(o: dict, ids: np.ndarray) -> None:
    """One document into a key's builder (an empty one is skipped and counted)."""
    if ids.size == 0:
        o["skipped"] += 1
        return
    o["builder"].add_document(ids, [int(ids.size)])
    o["max_id"] = max(o["max_id"], int(ids.max()))
    o["docs"] += 1
    o["tokens"] += int(ids.size)


def _publish(o: dict, tokenizer, dtype: str) -> dict:
    """Rename a key's finished files into place, then write its sidecar; the fields of its stats."""
    prefix = o["prefix"]
    bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
    sidecar_path(prefix).unlink(missing_ok=True)  # never leave an old sidecar beside new files
    os.replace(o["tmp_bin"], bin_path)
    os.replace(o["tmp_idx"], idx_path)
    sidecar = write_sidecar(prefix, tokenizer, max_token_id=o["max_id"], num_documents=o["docs"],
                            num_tokens=o["tokens"], dtype=dtype)
    return dict(num_documents=o["docs"], num_skipped_empty=o["skipped"], num_tokens=o["tokens"], dtype=dtype,
                max_token_id=o["max_id"], bin_path=bin_path, idx_path=idx_path, sidecar_path=str(sidecar))


def stdlib_corpus_files() -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library, sorted by path.

    Root: ``sysconfig.get_paths()["stdlib"]``. Left out: ``site-packages``/``dist-packages``,
    ``__pycache__``, and test suites (directories named ``test``, ``tests``, ``idle_test``). On
    CPython 3.11 that is ~800 files, ~12.6 MB.

    Raises:
        FileNotFoundError: the standard library directory does not exist or has no ``.py`` files.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into site-packages (it can be huge).
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library directory {root}")
    return sorted(files)


def _corpus_key(files: Sequence[Path], tokenizer) -> str:
    """sha256 over the file list (path, size, mtime), the Python version and the tokenizer."""
    listing = []
    for p in files:
        st = p.stat()
        listing.append([str(p), st.st_size, st.st_mtime_ns])
    payload = {
        "format": _CORPUS_FORMAT_VERSION,
        "python": list(sys.version_info[:3]),
        "tokenizer": dict(tokenizer.unique_identifiers),
        "files": listing,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _stamp_matches(directory: Path, key: str, tokenizer_name: str) -> bool:
    """True if ``directory`` holds the .bin, .idx and a stamp for this key and tokenizer."""
    prefix = directory / "stdlib"
    if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
        return False
    try:
        stamp = json.loads((directory / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("files_sha256") == key and stamp.get("tokenizer") == tokenizer_name


def ensure_stdlib_corpus(cache_dir: str | Path, tokenizer) -> str:
    """Build the standard-library corpus once and return its prefix (no .bin/.idx extension).

    Layout: ``<cache_dir>/corpus/stdlib-<tokenizer.name>-<key>/{stdlib.bin, stdlib.idx, stamp.json}``
    where ``key`` hashes the file list (paths, sizes, mtimes), the Python version and the tokenizer.
    A directory whose stamp matches is reused without reading any source file.

    Concurrency: the corpus is built in a private temporary directory and published with one
    atomic directory rename, so ranks that call this at the same time never see a partial corpus;
    a loser of the race discards its copy. (Callers still do better to build on one rank first and
    barrier, which saves the duplicate work.)

    Returns:
        the prefix as a string, e.g. ``.../stdlib-byte-0123abcd4567ef89/stdlib``.
    """
    files = stdlib_corpus_files()
    key = _corpus_key(files, tokenizer)
    root = Path(cache_dir).expanduser() / "corpus"
    final = root / f"stdlib-{tokenizer.name}-{key[:16]}"
    if _stamp_matches(final, key, tokenizer.name):
        return str(final / "stdlib")

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-stdlib-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stats = preprocess(files, tmp / "stdlib", tokenizer, append_eod=True)
        stamp = {"files_sha256": key, "tokenizer": tokenizer.name, "stats": asdict(stats)}
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2))
        if final.exists() and not _stamp_matches(final, key, tokenizer.name):
            # A damaged copy (e.g. files deleted by hand): move it aside, never publish over it.
            shutil.rmtree(final.rename(root / f".stale-{uuid.uuid4().hex[:8]}"), ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:
            if not _stamp_matches(final, key, tokenizer.name):
                raise
            # Another process published the same corpus first; ours is redundant.
        else:
            logger.info(
                "built the stdlib corpus: %d files, %d documents, %d tokens in %.1f s -> %s",
                stats.num_files, stats.num_documents, stats.num_tokens, stats.seconds, final,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final / "stdlib")
