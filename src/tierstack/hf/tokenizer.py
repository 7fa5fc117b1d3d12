"""Tokenizer files of an exported Hugging Face directory.

A run with a Hugging Face tokenizer exports that tokenizer's files. A run with the byte tokenizer
exports an equivalent ``tokenizer.json``: a byte-level BPE (``tokenizers``) with no merges whose
token for byte ``b`` (in GPT-2's byte-to-unicode alphabet, ``transformers``' ``bytes_to_unicode``)
has id ``b``, plus ``<|endoftext|>`` = 256, so ``AutoTokenizer`` encodes text to the same ids.
"""

from __future__ import annotations

import shutil
from pathlib import Path

BYTE_EOD_TOKEN = "<|endoftext|>"
_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")


def byte_level_tokenizer():
    """A ``tokenizers.Tokenizer`` giving the ids of :class:`tierstack.data.tokenizers.ByteTokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOD_TOKEN, special=True)])
    return tok


def write_tokenizer_files(tok_cfg, tokenizer, out: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained(out)``.

    Args:
        tok_cfg: the run's ``TokenizerConfig``.
        tokenizer: the run's tokenizer object (its ``eod`` becomes the EOS token).
    """
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    if tok_cfg.tokenizer_type == "byte":
        fast = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), eos_token=BYTE_EOD_TOKEN)
        fast.save_pretrained(str(out))
        return
    src = Path(tok_cfg.tokenizer_path)
    src_dir = src.parent if src.is_file() else src
    if all((src_dir / n).is_file() for n in _COMPANIONS[:1]):
        for name in ("tokenizer.json",) + _COMPANIONS:
            if (src_dir / name).is_file():
                shutil.copy2(src_dir / name, out / name)
        return
    fast = PreTrainedTokenizerFast(tokenizer_file=str(src_dir / "tokenizer.json"), eos_token=tokenizer.eod_token)
    fast.save_pretrained(str(out))
