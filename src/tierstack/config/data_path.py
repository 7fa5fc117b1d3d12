"""``dataset.data_path``: the one parser of Megatron's ways to name training data.

Megatron-LM's ``--data-path`` takes prefixes, or weights and prefixes in turn (``0.3 /a 0.7 /b``);
Megatron-Bridge's ``dataset.data_path`` also takes that as one space-separated string. Both forms
are read here, and every other form gets one error naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional


def _as_weight(item: Any) -> Optional[float]:
    """``item`` as a float if it is a number or a numeric string, else None."""
    if isinstance(item, bool):
        return None
    if isinstance(item, (int, float)):
        return float(item)
    try:
        return float(str(item))
    except ValueError:
        return None


def _items(data_path: Any) -> list:
    """The items of ``data_path``: a string is split on whitespace (Megatron's blend string), unless
    the whole string is itself a prefix on disk (a path with a space)."""
    if isinstance(data_path, os.PathLike):
        return [os.fspath(data_path)]
    if isinstance(data_path, str):
        if Path(f"{data_path}.bin").is_file():
            return [data_path]
        return data_path.split()
    if isinstance(data_path, (list, tuple)) and all(isinstance(x, (str, int, float, os.PathLike))
                                                    and not isinstance(x, bool) for x in data_path):
        return list(data_path)
    raise ValueError(
        f"dataset.data_path={data_path!r}: expected a prefix (/data/corpus_text_document), a list of "
        "prefixes, or weights and prefixes in turn (\"0.3 /data/a 0.7 /data/b\" or [0.3, /data/a, 0.7, /data/b])"
    )


def parse_data_path(data_path: Any) -> tuple[list[str], Optional[list[float]]]:
    """Split ``dataset.data_path`` into prefixes and optional blend weights (the one parser).

    Accepts one prefix (str), Megatron's space-separated string (``"0.3 /a 0.7 /b"`` or ``"/a /b"``),
    a list of prefixes, or ``[w1, p1, w2, p2, ...]`` (weights first, as in Megatron's ``--data-path``).
    A list is a blend only when it has even length and every other item, from the first, is a
    number; any other list holding a number is refused (``[1, a, b]``).

    Returns:
        ``(prefixes, weights)``; weights is None for an unweighted list.

    Raises:
        ValueError: not a string or list of strings and numbers; empty; a non-positive weight;
            numbers mixed with prefixes.
        FileNotFoundError: a prefix without ``.bin`` and ``.idx`` files.
    """
    items = _items(data_path)
    if not items:
        raise ValueError("dataset.data_path is empty; set it to prefixes or leave it null (the built-in corpus)")
    weighted = len(items) % 2 == 0 and all(_as_weight(w) is not None for w in items[0::2])
    if weighted:
        weights: Optional[list[float]] = [float(_as_weight(w)) for w in items[0::2]]  # type: ignore[arg-type]
        prefixes = [str(p) for p in items[1::2]]
        if any(w <= 0 for w in weights):
            raise ValueError(f"dataset.data_path weights must be > 0, got {weights}")
    else:
        if any(_as_weight(p) is not None for p in items):
            raise ValueError(
                f"dataset.data_path={items!r} mixes numbers and prefixes; use "
                "[prefix, ...] or [weight1, prefix1, weight2, prefix2, ...]"
            )
        weights, prefixes = None, [str(p) for p in items]
    for prefix in prefixes:
        missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not Path(f"{prefix}{ext}").is_file()]
        if missing:
            raise FileNotFoundError(
                f"dataset.data_path: {', '.join(f'{m} not found' for m in missing)} "
                "(give prefixes without the extension; build them with `tierstack preprocess`)"
            )
    return prefixes, weights
