"""The ``tierstack`` command: ``pretrain``, ``preprocess``, ``checkpoints ls|verify``.

``tierstack pretrain [RECIPE] [--nproc-per-node N] [section.field=value ...]`` runs a recipe by name
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


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from tierstack.recipes import DEFAULT_RECIPE, RECIPES, run

    # --nproc-per-node may come before the recipe (parsed by argparse) or after it (in items).
    launcher = argparse.ArgumentParser(prog="tierstack pretrain", add_help=False)
    launcher.add_argument("--nproc-per-node", type=int, default=args.nproc_per_node)
    known, items = launcher.parse_known_args(args.items)
    name = items.pop(0) if items and "=" not in items[0] and not items[0].startswith("-") else DEFAULT_RECIPE
    if name.endswith(".py"):
        config_fn = _file_recipe(name)
        if config_fn is None:
            return 2
    elif name in RECIPES:
        config_fn = RECIPES[name]
    else:
        print(f"tierstack pretrain: unknown recipe {name!r}; known: {', '.join(RECIPES)} (or a .py file)", file=sys.stderr)
        return 2
    launch_args = [] if known.nproc_per_node is None else ["--nproc-per-node", str(known.nproc_per_node)]
    return run(config_fn, [*launch_args, *items], rank_command=["-m", "tierstack.cli", "pretrain", name])


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from tierstack.config import TokenizerConfig
    from tierstack.data.preprocess import preprocess
    from tierstack.data.tokenizers import build_tokenizer

    tok = build_tokenizer(TokenizerConfig(tokenizer_type=args.tokenizer_type, tokenizer_path=args.tokenizer_path))
    try:
        stats = preprocess(args.input, args.output_prefix, tok, append_eod=not args.no_eod)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tierstack preprocess: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {stats.bin_path} and {stats.idx_path}: {stats.num_documents} documents, "
        f"{stats.num_tokens} tokens ({stats.dtype}) from {stats.num_files} file(s) in {stats.seconds:.1f} s; "
        f"tokenizer and max token id {stats.max_token_id} recorded in {stats.sidecar_path}"
    )
    return 0


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    from tierstack.checkpointing import listing

    fn = {"ls": listing.ls, "verify": listing.verify}[args.action]
    text, status = fn(args.path)
    print(text)
    return status


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="tierstack", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    pt = sub.add_parser(
        "pretrain", help="pretrain with a recipe (gpt_tiny unless named)",
        description="tierstack pretrain [RECIPE] [--nproc-per-node N] [section.field=value ...]: RECIPE is a "
        "name (gpt_tiny, gpt_small) or a .py file; --nproc-per-node validates the config, then launches "
        "N ranks on this machine (leave it out under torchrun).",
    )
    pt.add_argument("--nproc-per-node", type=int, default=None, help="validate, then launch N ranks here")
    pt.add_argument("items", nargs=argparse.REMAINDER, metavar="[RECIPE] [--nproc-per-node N] section.field=value")
    pt.set_defaults(func=_cmd_pretrain)

    pp = sub.add_parser("preprocess", help="text / JSONL files -> Megatron indexed dataset (.bin/.idx)")
    pp.add_argument("--input", nargs="+", required=True, help="text files (one document each) or .jsonl")
    pp.add_argument("--output-prefix", required=True, help="output path without .bin/.idx")
    pp.add_argument("--tokenizer-type", default="byte", choices=["byte", "huggingface"])
    pp.add_argument("--tokenizer-path", help="tokenizer.json for --tokenizer-type huggingface")
    pp.add_argument("--no-eod", action="store_true", help="do not end documents with the EOD token")
    pp.set_defaults(func=_cmd_preprocess)

    ck = sub.add_parser("checkpoints", help="list or verify checkpoints of both tiers")
    ck.add_argument("action", choices=["ls", "verify"])
    ck.add_argument("path", help="a GLOBAL save dir, a LOCAL root, a run dir, or one checkpoint")
    ck.set_defaults(func=_cmd_checkpoints)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tierstack`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command != "pretrain":  # pretrain configures logging per rank (training.reporting)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
