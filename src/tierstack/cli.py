"""The ``tierstack`` command: ``pretrain``, ``preprocess``, ``checkpoints ls|verify``, ``convert``, ``generate``.

``tierstack pretrain [RECIPE] [--nproc-per-node N [--max-restarts R]] [--restart launcher|in-process] [--config-file F] [--print-config |
--dry-run | --help] [section.field=value ...]`` runs a recipe by name
(``gpt_tiny`` by default, the same function as ``recipes/gpt_tiny.py``) or from a recipe file. With
``--nproc-per-node`` it validates the config, then launches the ranks; under torchrun
(``torchrun --nproc-per-node 2 -m tierstack.cli pretrain gpt_tiny ...``) each rank runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Optional, Sequence


def _file_recipe(path_text: str) -> Optional[Callable]:
    """The one ``*_config()`` function a recipe file defines, or None (the reason printed)."""
    import runpy
    from pathlib import Path

    path = Path(path_text)
    if not path.is_file():
        print(f"tierstack pretrain: recipe file {path} not found", file=sys.stderr)
        return None
    namespace = runpy.run_path(str(path), run_name="tierstack_recipe")
    fns = {v for k, v in namespace.items() if k.endswith("_config") and callable(v) and k != "gpt_config"}
    if len(fns) != 1:
        print(f"tierstack pretrain: {path} must define exactly one *_config() function", file=sys.stderr)
        return None
    return fns.pop()


def _recipe_list() -> str:
    """``pretrain --help``: how to run, then every recipe by name with its first docstring line."""
    from tierstack.recipes import DEFAULT_RECIPE, RECIPES
    from tierstack.recipes.runner import RUN_FLAGS, recipe_summary

    rows = [f"  {name:<14}{recipe_summary(fn)}" + ("  (default)" if name == DEFAULT_RECIPE else "")
            for name, fn in RECIPES.items()]
    return ("usage: tierstack pretrain [RECIPE | FILE.py] [flags] [section.field=value ...]\n\n"
            "recipes:\n" + "\n".join(rows) + "\n  FILE.py       a recipe file defining one *_config() function\n\n"
            + RUN_FLAGS + "\n\n`tierstack pretrain RECIPE --help` lists the recipe's sections and fields, "
            "with their values and what each means.")


def _cmd_pretrain(items: list[str]) -> int:
    """``tierstack pretrain [RECIPE] [flags] [overrides]`` (``items``: everything after ``pretrain``)."""
    from tierstack.recipes import DEFAULT_RECIPE, RECIPES, run

    if items[:1] in (["-h"], ["--help"]):  # before any recipe: the list of recipes
        print(_recipe_list())
        return 0
    # flags may come before the recipe or after it: the recipe is the first item that is neither a
    # flag, a flag's value nor an override
    takes_value = {"--nproc-per-node", "--max-restarts", "--restart", "--config-file"}
    index = next((i for i, item in enumerate(items) if "=" not in item and not item.startswith("-")
                  and (i == 0 or items[i - 1] not in takes_value)), None)
    name = items.pop(index) if index is not None else DEFAULT_RECIPE
    if name.endswith(".py"):
        config_fn = _file_recipe(name)
        if config_fn is None:
            return 2
    elif name in RECIPES:
        config_fn = RECIPES[name]
    else:
        print(f"tierstack pretrain: unknown recipe {name!r}; known: {', '.join(RECIPES)} (or a .py file)", file=sys.stderr)
        return 2
    return run(config_fn, items, rank_command=["-m", "tierstack.cli", "pretrain", name])


# Megatron-LM's --tokenizer-type names (tools/preprocess_data.py): the one tierstack has, and the others
MEGATRON_TOKENIZER_TYPES = {"HuggingFaceTokenizer": "huggingface"}
_MEGATRON_ONLY_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                             "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer",
                             "NullTokenizer")
TOKENIZER_TYPES = ("byte", "huggingface", *MEGATRON_TOKENIZER_TYPES)


def _tokenizer_type(name: str) -> str:
    """``--tokenizer-type``: tierstack's name for ``name`` (Megatron-LM's ``HuggingFaceTokenizer`` is
    ``huggingface``). Raises ValueError naming what to use instead."""
    if name in ("byte", "huggingface"):
        return name
    if name in MEGATRON_TOKENIZER_TYPES:
        return MEGATRON_TOKENIZER_TYPES[name]
    if name in _MEGATRON_ONLY_TOKENIZERS:
        raise ValueError(f"--tokenizer-type {name}: Megatron-LM's tokenizer, which tierstack does not have; use "
                         "--tokenizer-type HuggingFaceTokenizer --tokenizer-model <tokenizer.json or its directory> "
                         "(the model's Hugging Face tokenizer), or --tokenizer-type byte")
    raise ValueError(f"--tokenizer-type {name}: use one of {', '.join(TOKENIZER_TYPES)}")


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from tierstack.config import TokenizerConfig
    from tierstack.data.preprocess import preprocess, preprocess_json_keys
    from tierstack.data.tokenizers import build_tokenizer

    try:
        tok = build_tokenizer(TokenizerConfig(tokenizer_type=_tokenizer_type(args.tokenizer_type),
                                              tokenizer_path=args.tokenizer_path))
        kw = dict(append_eod=not args.no_eod, workers=args.workers)
        if len(args.json_keys) == 1:
            written = [preprocess(args.input, args.output_prefix, tok, json_key=args.json_keys[0], **kw)]
        else:
            written = list(preprocess_json_keys(args.input, args.output_prefix, tok, args.json_keys, **kw).values())
    except _bad_input_errors() as exc:
        print(f"tierstack preprocess: {exc}", file=sys.stderr)
        return 2
    for stats in written:
        print(
            f"wrote {stats.bin_path} and {stats.idx_path}: {stats.num_documents} documents, "
            f"{stats.num_tokens} tokens ({stats.dtype}) from {stats.num_files} file(s) in {stats.seconds:.1f} s; "
            f"tokenizer and max token id {stats.max_token_id} recorded in {stats.sidecar_path}"
        )
    return 0


class _NotOffered(argparse.Action):
    """A flag of Megatron-LM's ``preprocess_data.py`` that tierstack does not offer: refused by name."""

    def __init__(self, option_strings, dest, nargs="?", **kw):
        super().__init__(option_strings, dest, nargs=nargs, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: a flag of Megatron-LM's preprocess_data.py that tierstack preprocess does not "
                     "offer (no sentence splitting, input partitions or vocab/merge-file tokenizers); leave it out")


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    from tierstack.checkpointing import listing

    fn = {"ls": listing.ls, "verify": listing.verify}[args.action]
    text, status = fn(args.path)
    print(text)
    return status


def _bad_input_errors() -> tuple:
    from tierstack.errors import BadInputError
    from tierstack.hf import HFCheckpointError, UnsupportedModelError
    from tierstack.hf.checkpoint_io import CheckpointNotFoundError

    # BadInputError covers ConfigError and a damaged tokenizer.json (data.tokenizers)
    return (HFCheckpointError, UnsupportedModelError, CheckpointNotFoundError, BadInputError, ValueError,
            FileNotFoundError)


def _cmd_convert(args: argparse.Namespace) -> int:
    from tierstack import hf

    try:
        if args.direction == "import":
            path = hf.import_hf(args.hf_path, args.save, tensor_model_parallel_size=args.tp,
                                pipeline_model_parallel_size=args.pp,
                                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        else:
            path = hf.export_hf(args.load, args.hf_path, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except _bad_input_errors() as exc:
        print(f"tierstack convert {args.direction}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import os

    from tierstack.hf.generate import SamplingConfig, generate

    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    try:
        out = generate(args.load, args.prompt, sampling)
    except _bad_input_errors() as exc:
        print(f"tierstack generate: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(args.prompt + out.text)
        logging.getLogger("tierstack").info("new token ids: %s", out.new_ids)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="tierstack", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    # `tierstack pretrain ...` is parsed by _cmd_pretrain and recipes.run (main() hands it over):
    # this entry is what `tierstack --help` lists
    sub.add_parser("pretrain", add_help=False, help="pretrain with a recipe (gpt_tiny unless named); "
                   "`tierstack pretrain --help` lists the recipes and flags")

    pp = sub.add_parser("preprocess", help="text / JSONL files -> Megatron indexed dataset (.bin/.idx)",
                        description="Tokenize text and JSONL files into a Megatron indexed dataset. The flags "
                        "are Megatron-LM's tools/preprocess_data.py ones where they mean the same.")
    pp.add_argument("--input", nargs="+", required=True, help="text files (one document each) or .jsonl files "
                    "(one document per line), read in this order")
    pp.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                    help="JSONL fields to tokenize (default: text); one key writes OUTPUT_PREFIX.bin/.idx, several "
                    "write one dataset per key, OUTPUT_PREFIX_<key>_document.bin/.idx (Megatron-LM's names)")
    pp.add_argument("--output-prefix", required=True, help="output path without .bin/.idx")
    pp.add_argument("--tokenizer-type", default="byte", metavar="TYPE",
                    help=f"one of {', '.join(TOKENIZER_TYPES)} (HuggingFaceTokenizer, Megatron-LM's name, is "
                    "huggingface); default byte")
    pp.add_argument("--tokenizer-model", "--tokenizer-path", dest="tokenizer_path",
                    help="tokenizer.json (or its directory) for a Hugging Face tokenizer")
    pp.add_argument("--workers", type=int, default=1, help="processes that tokenize (default 1); the output is "
                    "the same, byte for byte, for any number")
    eod = pp.add_mutually_exclusive_group()
    eod.add_argument("--append-eod", action="store_true",
                     help="end each document with the EOD token: the default here (Megatron-LM's flag, accepted)")
    eod.add_argument("--no-eod", action="store_true", help="do not end documents with the EOD token")
    for flag in ("--split-sentences", "--keep-newlines", "--partitions", "--vocab-file", "--merge-file", "--lang",
                 "--keep-sequential-samples", "--log-interval"):
        pp.add_argument(flag, action=_NotOffered)
    pp.set_defaults(func=_cmd_preprocess)

    ck = sub.add_parser("checkpoints", help="list or verify checkpoints of both tiers")
    ck.add_argument("action", choices=["ls", "verify"])
    ck.add_argument("path", help="a GLOBAL save dir, a LOCAL root, a run dir, or one checkpoint")
    ck.set_defaults(func=_cmd_checkpoints)

    cv = sub.add_parser("convert", help="Hugging Face checkpoint <-> GLOBAL checkpoint (one CPU process)")
    cvs = cv.add_subparsers(dest="direction", required=True)
    imp = cvs.add_parser("import", help="HF directory (config.json + safetensors) -> GLOBAL checkpoint of step 0")
    imp.add_argument("--hf-path", required=True, help="directory with config.json, *.safetensors, tokenizer.json")
    imp.add_argument("--save", required=True, help="GLOBAL checkpoint root to create")
    imp.add_argument("--tp", type=int, default=1, help="tensor-parallel size the run will use (vocabulary padding)")
    imp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the run will use")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                     help="vocabulary padding multiple (times --tp); default: model.make_vocab_size_divisible_by")
    exp = cvs.add_parser("export", help="GLOBAL checkpoint (any TP/PP/DP) -> HF directory")
    exp.add_argument("--load", required=True, help="GLOBAL root (newest step) or ROOT/iter_NNNNNNN")
    exp.add_argument("--hf-path", required=True, help="output directory")
    exp.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    exp.add_argument("--max-shard-size", default="5GB", help="safetensors shard size limit (e.g. 5GB, 200MB)")
    cv.set_defaults(func=_cmd_convert)

    gen = sub.add_parser("generate", help="sample text from a GLOBAL checkpoint (torchrun: one rank per TP rank)")
    gen.add_argument("--load", required=True, help="GLOBAL root (newest step) or ROOT/iter_NNNNNNN")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus filter")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)
    return p


def _quiet_logging() -> None:
    """The commands other than ``pretrain`` log as ``pretrain`` does: tierstack's own INFO lines (as
    plain messages), every library's warnings, and none of the libraries' INFO notices (megatron-core
    logs its DDP and optimizer configs, and Megatron-FSDP notices, at INFO); no progress bars of
    Hugging Face ``transformers`` while it loads or saves weights."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("tierstack").setLevel(logging.INFO)
    try:
        from transformers.utils import logging as hf_logging  # the `hf` extra; absent: nothing to quiet
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tierstack`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pretrain"]:  # pretrain configures logging per rank (training.reporting)
        status = _cmd_pretrain(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        _quiet_logging()
        status = args.func(args)
    from tierstack.runtime import process_exiting

    process_exiting()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
