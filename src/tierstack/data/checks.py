"""Dataset files are checked at setup, on every rank, before any run artifact exists.

For each Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``) a run trains on:

1. the ``.idx`` parses (megatron-core's own index reader) and is self-consistent (file size, sequence
   pointers, document boundaries);
2. the ``.bin`` has exactly the size the index implies (a short ``.bin`` would otherwise fail on the
   first sample drawn past its end, which with shuffling can be hours into a run);
3. the token dtype can hold every id of the run's tokenizer;
4. every token id is below the tokenizer's vocabulary size. megatron-core's vocab-parallel embedding
   and cross-entropy (TP > 1) mask ids outside each partition, so out-of-range ids would silently
   train as zero embeddings and ignored targets.

``tierstack preprocess`` writes a sidecar ``<prefix>.meta.json`` (:func:`write_sidecar`): the
tokenizer's identity, the max token id, document and token counts. With it, check 4 reads a few
hundred bytes, and data tokenized with another tokenizer is refused even when its ids happen to fit.
Files without a sidecar (made by other tools) are scanned once (a memory-mapped max); the result is
cached under ``<dataset.cache_dir>/token_stats/``, beside megatron-core's index cache ``indices/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from tierstack.data.tokenizers import describe_tokenizer, same_tokenizer, tokenizer_identity
from tierstack.errors import BadInputError

logger = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".meta.json"
SIDECAR_VERSION = 2  # 2: the size and mtime of the .bin and .idx it describes
_HEADER_BYTES = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_REBUILD = "re-run `tierstack preprocess` to rebuild it"


class DataFileError(BadInputError, ValueError):
    """Dataset files a run cannot train on; ``problems`` lists each, naming its file."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"bad training data ({len(self.problems)} problem(s)); nothing was started:\n{lines}")


@dataclass(frozen=True)
class IndexSummary:
    """What one ``.idx`` says about its ``.bin``.

    Attributes:
        dtype: numpy dtype of the token ids in the ``.bin``.
        num_sequences: sequences (megatron-core's unit; one per document for our preprocess).
        num_documents: documents (entries of the document index minus one).
        num_tokens: token ids in the ``.bin`` (sum of the sequence lengths).
        bin_bytes: the exact ``.bin`` size this implies, ``num_tokens * dtype.itemsize``.
    """

    dtype: np.dtype
    num_sequences: int
    num_documents: int
    num_tokens: int
    bin_bytes: int


def sidecar_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SIDECAR_SUFFIX}")


def read_index(prefix: str | Path) -> IndexSummary:
    """Parse ``<prefix>.idx`` with megatron-core's ``_IndexReader`` and check its consistency.

    Raises:
        DataFileError: the ``.idx`` is unreadable, truncated, or inconsistent (the message names the
            file and says to re-run ``tierstack preprocess``).
    """
    from megatron.core.datasets.indexed_dataset import _IndexReader

    idx = f"{prefix}.idx"
    try:
        reader = _IndexReader(idx, multimodal=False)
    except Exception as err:  # noqa: BLE001 - assert, struct.error, ValueError, KeyError: all name the file
        raise DataFileError([f"{idx}: not a readable Megatron index ({_short(err)}); {_REBUILD}"]) from None
    try:
        return _summarize(idx, reader)
    finally:
        del reader


def _summarize(idx: str, reader) -> IndexSummary:
    n, d = int(reader.sequence_count), int(reader.document_count)
    want = _HEADER_BYTES + 4 * n + 8 * n + 8 * d
    size = os.path.getsize(idx)
    if size != want:
        raise DataFileError([
            f"{idx}: {size} bytes, but its header ({n} sequences, {d - 1} documents) needs {want}; {_REBUILD}"
        ])
    lengths = reader.sequence_lengths.astype(np.int64)
    pointers, docs = reader.sequence_pointers, reader.document_indices
    item = np.dtype(reader.dtype).itemsize
    problem = None
    if n and int(lengths.min()) < 0:
        problem = "negative sequence lengths"
    elif n and (int(pointers[0]) != 0 or not np.array_equal(np.diff(pointers), lengths[:-1] * item)):
        problem = "sequence pointers do not follow the sequence lengths"
    elif d < 1 or int(docs[0]) != 0 or int(docs[-1]) != n or bool(np.any(np.diff(docs) < 0)):
        problem = "document boundaries do not cover the sequences"
    if problem:
        raise DataFileError([f"{idx}: {problem}; {_REBUILD}"])
    tokens = int(lengths.sum())
    return IndexSummary(np.dtype(reader.dtype), n, d - 1, tokens, tokens * item)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{type(err).__name__}: {text}" if not text.startswith(type(err).__name__) else text


def write_sidecar(prefix: str | Path, tokenizer, *, max_token_id: int, num_documents: int, num_tokens: int,
                  dtype: str) -> Path:
    """Write ``<prefix>.meta.json`` beside the ``.bin``/``.idx`` (called by ``tierstack preprocess``).

    Fields: ``format_version``, ``tokenizer`` (:func:`tokenizer_identity`), ``max_token_id`` (-1 for
    an empty dataset), ``num_documents``, ``num_tokens``, ``dtype`` (numpy name), ``bin_bytes``,
    ``files`` (``{".bin": [size bytes, mtime ns], ".idx": [...]}`` of the files as they are now:
    call it after both are written). Written to a temporary name and renamed, so readers see a
    whole file or none.
    """
    path = sidecar_path(prefix)
    meta = {
        "format_version": SIDECAR_VERSION,
        "tokenizer": tokenizer_identity(tokenizer),
        "max_token_id": int(max_token_id),
        "num_documents": int(num_documents),
        "num_tokens": int(num_tokens),
        "dtype": str(dtype),
        "bin_bytes": int(num_tokens) * np.dtype(dtype).itemsize,
        "files": _file_stats(prefix),
    }
    _replace_text(path, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return path


def _file_stats(prefix: str | Path) -> dict:
    """``{".bin": [size, mtime_ns], ".idx": [size, mtime_ns]}``: what tells a sidecar's files from
    files rewritten in place later (same token count, other tokens), as ``make`` tells stale targets."""
    out = {}
    for ext in (".bin", ".idx"):
        st = os.stat(f"{prefix}{ext}")
        out[ext] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path`` and rename it over ``path``.

    Raises:
        OSError: the write or rename failed; the temp file is removed first (nothing left beside ``path``).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_sidecar(prefix: str, summary: IndexSummary) -> Optional[dict]:
    """The sidecar when it describes these very files; None when absent or stale (logged)."""
    path = sidecar_path(prefix)
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        logger.warning("data check: ignoring unreadable %s (%s); scanning the tokens instead", path, err)
        return None
    fits = (
        isinstance(meta, dict) and meta.get("format_version") == SIDECAR_VERSION
        and meta.get("num_tokens") == summary.num_tokens and meta.get("num_documents") == summary.num_documents
        and meta.get("dtype") == summary.dtype.name and isinstance(meta.get("max_token_id"), int)
    )
    if not fits:
        logger.warning("data check: %s does not describe the current .bin/.idx (rebuilt by another tool, "
                       "or written by an older tierstack?); scanning the tokens instead", path)
        return None
    if meta.get("files") != _file_stats(prefix):
        logger.warning("data check: %s.bin/.idx changed after %s was written (size or modification time: "
                       "rewritten or copied without -p?); scanning the tokens instead of trusting it", prefix, path)
        return None
    return meta


def _scan_cache_file(prefix: str, cache_dir: Optional[str]) -> Optional[Path]:
    if not cache_dir:
        return None
    parts = []
    for ext in (".bin", ".idx"):
        st = os.stat(f"{prefix}{ext}")
        parts.append([os.path.realpath(f"{prefix}{ext}"), st.st_size, st.st_mtime_ns])
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
    return Path(cache_dir).expanduser() / "token_stats" / f"{key}.json"


def scan_token_range(prefix: str, summary: IndexSummary, cache_dir: Optional[str]) -> tuple[int, int, str]:
    """``(min id, max id, how)`` of ``<prefix>.bin``: from the scan cache, else a memory-mapped scan.

    ``how`` says where the numbers came from and what a scan cost (seconds, bytes), for the log.
    An empty ``.bin`` gives ``(0, -1, ...)``. The cache key is the real paths, sizes and mtimes of
    both files, so a rebuilt dataset is scanned again.
    """
    cache = _scan_cache_file(prefix, cache_dir)
    if cache is not None and cache.is_file():
        try:
            hit = json.loads(cache.read_text())
            return int(hit["min_token_id"]), int(hit["max_token_id"]), f"scan cache {cache}"
        except (OSError, ValueError, KeyError):
            pass
    t0 = time.perf_counter()
    lo, hi = 0, -1
    if summary.num_tokens:
        data = np.memmap(f"{prefix}.bin", dtype=summary.dtype, mode="r", shape=(summary.num_tokens,))
        lo, hi = int(data.min()), int(data.max())
        del data
    seconds = time.perf_counter() - t0
    how = f"scanned {summary.bin_bytes / 1e6:.1f} MB in {seconds:.3f} s (no sidecar)"
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            _replace_text(cache, json.dumps({"bin": f"{prefix}.bin", "min_token_id": lo, "max_token_id": hi,
                                             "num_tokens": summary.num_tokens, "scan_seconds": seconds}))
            how += f"; cached in {cache}"
        except OSError as err:
            how += f"; not cached ({err})"
    return lo, hi, how


def check_prefix(prefix: str, tokenizer, cache_dir: Optional[str] = None) -> tuple[list[str], str]:
    """Every check of the module docstring on one dataset; ``(problems, summary line for the log)``.

    Problems name the file to fix and what to do. Never raises for bad files (only for bugs).
    """
    try:
        summary = read_index(prefix)
    except DataFileError as err:
        return err.problems, ""
    bin_path = f"{prefix}.bin"
    size = os.path.getsize(bin_path)
    if size != summary.bin_bytes:
        return [f"{bin_path}: {size} bytes, but {prefix}.idx describes {summary.num_tokens} tokens of "
                f"{summary.dtype.name} = {summary.bin_bytes} bytes (a {'short' if size < summary.bin_bytes else 'long'}"
                f" or foreign .bin); {_REBUILD}"], ""
    run_tok = tokenizer_identity(tokenizer)
    vocab = run_tok["vocab_size"]
    problems = []
    if np.iinfo(summary.dtype).max < vocab - 1:
        problems.append(f"{bin_path}: token ids are {summary.dtype.name}, which cannot hold the ids of "
                        f"{describe_tokenizer(run_tok)}; re-run `tierstack preprocess` with this tokenizer")
    meta = _read_sidecar(prefix, summary)
    if meta is not None:
        lo, hi, how = 0, int(meta["max_token_id"]), f"sidecar {sidecar_path(prefix).name}, no scan"
        if not same_tokenizer(meta.get("tokenizer") or {}, run_tok):
            problems.append(
                f"{prefix}.bin/.idx were tokenized with {describe_tokenizer(meta.get('tokenizer'))} (per "
                f"{sidecar_path(prefix)}), but this run uses {describe_tokenizer(run_tok)}; set tokenizer.* "
                "to the data's tokenizer, or re-run `tierstack preprocess` with the run's"
            )
    else:
        lo, hi, how = scan_token_range(prefix, summary, cache_dir)
    if hi >= vocab or lo < 0:
        problems.append(
            f"{bin_path}: token ids {lo}..{hi}, outside the vocabulary 0..{vocab - 1} of "
            f"{describe_tokenizer(run_tok)} (data tokenized with another tokenizer?); set tokenizer.* to "
            "the data's tokenizer, or re-run `tierstack preprocess` with the run's"
        )
    line = (f"{prefix}: {summary.num_documents} documents, {summary.num_tokens} tokens ({summary.dtype.name}), "
            f"ids {lo}..{hi}, vocabulary {vocab} [{how}]")
    return problems, line


def check_datasets(prefixes: list[str], tokenizer, cache_dir: Optional[str] = None) -> None:
    """Collective when torch.distributed is up: check every prefix on every rank, agree, raise alike.

    Global rank 0 checks first (and fills the scan cache), then the others (a barrier between), so a
    dataset without a sidecar is scanned once per file system; then ranks all-gather their problems.
    A problem seen on one rank only (a node-local copy) stops every rank, naming the ranks.

    Raises:
        DataFileError: on every rank, listing each problem once.
    """
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if up else (0, 1)

    def run_checks() -> dict:
        out: dict = {"problems": [], "lines": []}
        t0 = time.perf_counter()
        for prefix in prefixes:
            problems, line = check_prefix(prefix, tokenizer, cache_dir)
            out["problems"] += problems
            out["lines"] += [line] if line else []
        out["seconds"] = time.perf_counter() - t0
        return out

    mine = run_checks() if rank == 0 else None
    if up:
        dist.barrier()  # sync point: the others find rank 0's scan cache
    if rank != 0:
        mine = run_checks()
    views = [None] * world
    if up:
        dist.all_gather_object(views, mine)
    else:
        views = [mine]
    if rank == 0:
        for line in views[0]["lines"]:
            logger.info("data check: %s", line)
        logger.info("data check: %d dataset(s) on %d rank(s) in %.3f s (rank 0)",
                    len(prefixes), world, views[0]["seconds"])
    _raise_agreed(views)


def _raise_agreed(views: list[dict]) -> None:
    seen: dict[str, list[int]] = {}
    for r, view in enumerate(views):
        for p in view["problems"]:
            seen.setdefault(p, []).append(r)
    if not seen:
        return
    world = len(views)
    raise DataFileError([
        p if len(ranks) == world else f"{p} (seen on rank(s) {', '.join(map(str, ranks))})"
        for p, ranks in seen.items()
    ])
