"""Data pipeline: tokenizers, preprocessing to Megatron indexed datasets, GPT datasets, samplers.

Modules (imported directly; this package imports nothing so that ``import tierstack.data`` stays
cheap and does not pull in megatron-core):

- :mod:`tierstack.data.tokenizers`: ``ByteTokenizer``, ``HuggingFaceTokenizer``, ``build_tokenizer``
- :mod:`tierstack.data.preprocess`: ``preprocess``, ``stdlib_corpus_files``, ``ensure_stdlib_corpus``
- :mod:`tierstack.data.datasets`: ``build_train_valid_datasets``
- :mod:`tierstack.data.samplers`: ``PretrainingSampler``, ``build_data_iterator``,
  ``build_cyclic_iterator``
"""
