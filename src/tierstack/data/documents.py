"""The documents of input files and their token ids, in input order, in this process or a pool.

A plain text file is one document; a ``.jsonl`` file is one document per non-blank line and per
JSON key asked for (``--json-keys``, Megatron-LM's ``preprocess_data.py`` flag: each key is its
own dataset). Tokenizing is spread over ``workers`` processes with :class:`multiprocessing.Pool`
(``imap``, which keeps the order), so the output is the same for any number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.pool
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

JSONL_SUFFIXES = (".jsonl",)
_CHUNK = 64  # records per task sent to a worker: large enough to hide the pickling, small enough to stream

_worker: dict = {}  # the tokenizer and settings of a pool worker (set by _init_worker)


def records(path: Path, keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Yield one tuple of texts (one per key of ``keys``) per document of ``path``.

    A ``.jsonl`` file yields each non-blank line's ``keys``; any other file is one document (with
    one key only), decoded as UTF-8 with invalid bytes replaced by U+FFFD.

    Raises:
        ValueError: a JSONL line that is not UTF-8 or JSON, or lacks a string under one of
            ``keys`` (the message names the file, the 1-based line number and the key); a plain
            text file with several keys.
    """
    if path.suffix.lower() not in JSONL_SUFFIXES:
        if len(keys) > 1:
            raise ValueError(f"{path}: a plain text file is one document, but --json-keys names {len(keys)} keys; "
                             "several keys need .jsonl inputs")
        yield (path.read_bytes().decode("utf-8", errors="replace"),)
        return
    with open(path, "rb") as stream:
        for lineno, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{path}:{lineno}: not a valid JSON line ({err})") from None
            texts = tuple(record.get(key) if isinstance(record, dict) else None for key in keys)
            for key, text in zip(keys, texts):
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: the record has no {json.dumps(key)} string (--json-keys)")
            yield texts


def encode(tokenizer, text: str, append_eod: bool) -> np.ndarray:
    """Token ids of one document as a 1-D integer array, with the end id appended if asked.

    Raises:
        ValueError: the tokenizer returned an id outside ``0 .. vocab_size - 1``.
    """
    fast = getattr(tokenizer, "tokenize_array", None)
    ids = fast(text) if fast is not None else np.asarray(tokenizer.tokenize(text), dtype=np.int64)
    if append_eod:
        ids = np.concatenate([ids, np.asarray([tokenizer.eod], dtype=ids.dtype)])
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
        raise ValueError(
            f"tokenizer returned ids in {int(ids.min())}..{int(ids.max())}, outside its "
            f"vocabulary 0..{tokenizer.vocab_size - 1}"
        )
    return ids


def _init_worker(tokenizer, append_eod: bool) -> None:
    _worker.update(tokenizer=tokenizer, append_eod=append_eod)


def _encode_record(texts: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    return tuple(encode(_worker["tokenizer"], text, _worker["append_eod"]) for text in texts)


def encoded(paths: Sequence[Path], keys: Sequence[str], tokenizer, append_eod: bool,
            workers: int = 1) -> Iterator[tuple[np.ndarray, ...]]:
    """The token ids of every document of ``paths`` (a tuple: one array per key), in input order.

    Args:
        workers: processes that tokenize (1: this one). The pool is started with ``spawn`` (this
            process has imported torch, whose threads make ``fork`` unsafe), each worker gets
            ``tokenizer`` once, and ``imap`` returns the results in input order.

    Raises:
        ValueError: see :func:`records` and :func:`encode`.
    """
    texts = (record for path in paths for record in records(path, keys))
    if workers <= 1:
        for record in texts:
            yield tuple(encode(tokenizer, text, append_eod) for text in record)
        return
    pool: Optional[multiprocessing.pool.Pool] = None
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker,
                                                         initargs=(tokenizer, append_eod))
        yield from pool.imap(_encode_record, texts, chunksize=_CHUNK)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
