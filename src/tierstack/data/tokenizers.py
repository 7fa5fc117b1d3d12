"""Tokenizers: a byte-level one (no files, vocab 257) and a local Hugging Face ``tokenizer.json``.

megatron-core's datasets take any object with this duck-typed surface (read from
``megatron/core/datasets/gpt_dataset.py`` and ``megatron_dataset.py`` in 0.16.1):

- ``vocab_size`` (int): ``GPTDatasetConfig`` picks the token dtype code from it, and
  ``MockGPTDataset`` draws ids below it.
- ``eod`` (int): the end-of-document id; ``GPTDataset`` passes it to the mask/position-id builder
  and ``MockGPTDataset`` ends each synthetic document with it.
- ``unique_identifiers`` (JSON-serialisable dict): every dataset hashes its config into the name of
  its cached index files with ``json.dumps(..., default=lambda obj: obj.unique_identifiers)``; a
  tokenizer without it fails with ``AttributeError`` inside ``json.dumps``.
- ``pad`` is optional. It is read in a ``try`` and falls back to -1 when missing, and a pad equal to
  ``eod`` is reset to -1 with a warning. So these tokenizers define no ``pad`` on purpose.

No ``isinstance(…, MegatronTokenizerBase)`` check exists, so the classes here do not inherit from it
(its abstract methods include chat templates we have no use for).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from tierstack.config.sections import TokenizerConfig, tokenizer_file

# Tried in this order when no end token is configured.
COMMON_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus one end-of-document id 256 (vocab_size 257).

    Needs no files; every string round-trips exactly through ``tokenize``/``detokenize``.
    """

    EOD_ID = 256

    def __init__(self) -> None:
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__, "vocab_size": 257})

    @property
    def name(self) -> str:
        """Short stable name used in cache stamps: ``"byte"``."""
        return "byte"

    @property
    def vocab_size(self) -> int:
        """Number of ids, 257 (256 byte values + end of document)."""
        return self.EOD_ID + 1

    @property
    def eod(self) -> int:
        """End-of-document id, 256."""
        return self.EOD_ID

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` as UTF-8 and return one id (0..255) per byte; no end token is added."""
        return list(text.encode("utf-8"))

    def tokenize_array(self, text: str) -> np.ndarray:
        """Like :meth:`tokenize` but returns a 1-D ``uint16`` array (fast path for preprocessing)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def tokenize_bytes(self, data: bytes) -> np.ndarray:
        """Ids of raw bytes without decoding: 1-D ``uint16`` array, one id per byte."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids back to text. The end id (256) is dropped; invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: an id outside 0..256.
        """
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > self.EOD_ID):
            raise ValueError(f"ByteTokenizer ids must be in 0..{self.EOD_ID}, got {arr.min()}..{arr.max()}")
        return arr[arr != self.EOD_ID].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eod=256)"


def _import_tokenizers():
    """Import the optional ``tokenizers`` package or explain how to install it."""
    try:
        import tokenizers  # noqa: PLC0415 (optional dependency, imported only when asked for)
    except ImportError as err:
        raise ImportError(
            "tokenizer.tokenizer_type=huggingface needs the 'tokenizers' package: "
            "pip install tokenizers (or install the extra: pip install 'tierstack[hf]')"
        ) from err
    return tokenizers


class HuggingFaceTokenizer:
    """A local Hugging Face ``tokenizer.json`` loaded through the ``tokenizers`` package.

    Args:
        path: the ``tokenizer.json`` file, or a directory holding one.
        eod_token: the end-of-document token string; None tries ``<|endoftext|>``, ``</s>``,
            ``<eos>``, ``<|end_of_text|>`` in that order.

    Raises:
        ImportError: ``tokenizers`` is not installed (names ``pip install tokenizers``).
        FileNotFoundError: no tokenizer.json at ``path`` (names tokenizer.tokenizer_path).
        ConfigError: no end-of-document token found (names tokenizer.tokenizer_path; a ValueError
            and a BadInputError, so a launch refuses it in one line with exit status 2).
        BadInputError: the file is not a readable tokenizer.json (damaged, cut short; names it).
    """

    def __init__(self, path: str | Path, eod_token: Optional[str] = None) -> None:
        file = tokenizer_file(path)
        if not file.is_file():
            raise FileNotFoundError(
                f"tokenizer.tokenizer_path={str(path)!r}: no tokenizer.json found there"
            )
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises a bare Exception for a damaged file
            from tierstack.errors import BadInputError

            raise BadInputError(f"tokenizer.tokenizer_path={str(path)!r}: {file} is not a readable tokenizer.json "
                                f"({e}); replace the file (or give another tokenizer)") from None
        self.path = file.resolve()
        candidates = (eod_token,) if eod_token is not None else COMMON_EOD_TOKENS
        found = [(t, self._tok.token_to_id(t)) for t in candidates]
        found = [(t, i) for t, i in found if i is not None]
        if not found:  # bad input, refused in one line like a damaged file (ConfigError is a ValueError)
            from tierstack.config.base import ConfigError

            raise ConfigError([
                f"tokenizer.tokenizer_path={str(path)!r}: none of the end-of-document tokens "
                f"{list(candidates)} is in the vocabulary; use a tokenizer that has one"
            ])
        self.eod_token, self._eod = found[0]
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # The file hash makes cached dataset indices follow the tokenizer's content, not its path.
        self._sha = hashlib.sha256(file.read_bytes()).hexdigest()
        self.unique_identifiers = OrderedDict(
            **{"class": type(self).__name__, "sha256": self._sha, "eod": self._eod}
        )

    @property
    def name(self) -> str:
        """Short stable name used in cache stamps: ``"hf-<first 12 hex of the file's sha256>"``."""
        return f"hf-{self._sha[:12]}"

    @property
    def vocab_size(self) -> int:
        """Number of ids including added special tokens."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """Id of the end-of-document token (see ``eod_token``)."""
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added (no BOS/EOS templates)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept in the output."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({str(self.path)!r}, vocab_size={self._vocab_size}, eod={self._eod})"


def build_tokenizer(cfg: TokenizerConfig) -> ByteTokenizer | HuggingFaceTokenizer:
    """Build the tokenizer a :class:`TokenizerConfig` asks for.

    ``cfg.eod_token`` is used when that field exists (it is optional; see HuggingFaceTokenizer).

    Raises:
        ConfigError (a ValueError): the section's own rules (``TokenizerConfig.problems``): an
            unknown ``tokenizer.tokenizer_type``, or ``huggingface`` without an existing
            ``tokenizer.tokenizer_path``.
    """
    cfg.validate()
    if cfg.tokenizer_type == "byte":
        return ByteTokenizer()
    return HuggingFaceTokenizer(cfg.tokenizer_path, eod_token=getattr(cfg, "eod_token", None))


def tokenizer_identity(tokenizer) -> dict:
    """What makes two tokenizers the same, as a JSON-ready dict (recorded in data sidecars and checkpoints).

    Keys: ``type`` ("byte" or "huggingface"), ``vocab_size`` (ids, unpadded), ``eod`` (end id),
    ``sha256`` (of the tokenizer.json; None for the byte tokenizer, which has no file) and ``path``
    (where the file was, for messages only: it is not compared).
    """
    if isinstance(tokenizer, ByteTokenizer):
        kind = "byte"
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        kind = "huggingface"
    else:  # any duck-typed tokenizer megatron-core accepts
        kind = type(tokenizer).__name__
    path = getattr(tokenizer, "path", None)
    return {
        "type": kind,
        "vocab_size": int(tokenizer.vocab_size),
        "eod": int(tokenizer.eod),
        "sha256": dict(getattr(tokenizer, "unique_identifiers", {}) or {}).get("sha256"),
        "path": str(path) if path is not None else None,
    }


def same_tokenizer(a: dict, b: dict) -> bool:
    """True when two :func:`tokenizer_identity` dicts name the same vocabulary (the path is not compared)."""
    return all(a.get(k) == b.get(k) for k in ("type", "vocab_size", "eod", "sha256"))


def describe_tokenizer(identity: Optional[dict]) -> str:
    """One-line description of a :func:`tokenizer_identity` dict, e.g. for error messages."""
    if not identity:
        return "an unrecorded tokenizer"
    if identity.get("type") != "huggingface":
        return f"the {identity.get('type')} tokenizer (vocabulary {identity.get('vocab_size')})"
    sha = (identity.get("sha256") or "")[:12]
    return (
        f"the Hugging Face tokenizer {identity.get('path')} (vocabulary {identity.get('vocab_size')}, "
        f"sha256 {sha}...)"
    )


_IDENTITY_CACHE: dict = {}


def identity_of_config(cfg: TokenizerConfig) -> dict:
    """:func:`tokenizer_identity` of the tokenizer ``cfg`` builds, cached per file version.

    Checkpoint saves call this at every save; the tokenizer is built once per (type, path, mtime).
    """
    key: tuple = (cfg.tokenizer_type.lower(), cfg.tokenizer_path)
    if cfg.tokenizer_path:
        try:
            st = Path(cfg.tokenizer_path).expanduser().stat()
            key += (st.st_mtime_ns, st.st_size)
        except OSError:
            pass
    if key not in _IDENTITY_CACHE:
        _IDENTITY_CACHE[key] = tokenizer_identity(build_tokenizer(cfg))
    return dict(_IDENTITY_CACHE[key])
