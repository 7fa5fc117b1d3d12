"""A real Hugging Face tokenizer for tests: byte-level BPE with 2,000 ids, trained in seconds, no download."""

import pytest

from tierstack.data.tokenizers import HuggingFaceTokenizer

TEXT = "def f(x):\n    return x * 2  # ünïcödé ✓\n" * 40


def train_bpe(path, vocab_size=2000):
    """Write a byte-level BPE ``tokenizer.json`` with ``vocab_size`` ids at ``path`` and load it."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    words = [f"tok{i} w{i * 7} {TEXT[: i % 50]}" for i in range(3000)]
    tok.train_from_iterator(words, trainer)
    tok.save(str(path))
    return HuggingFaceTokenizer(path)
