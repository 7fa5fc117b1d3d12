"""The ``tierstack`` command: ``pretrain``, ``preprocess``, ``checkpoints ls|verify``.

``tierstack pretrain`` runs the gpt_tiny recipe in this process; launch it under torchrun for
several ranks (``torchrun --nproc-per-node 2 -m tierstack.cli pretrain key=value ...``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence


def _cmd_pretrain(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    from tierstack.recipes import run

    if args.recipe:
        path = Path(args.recipe)
        if not path.is_file():
            print(f"tierstack pretrain: recipe file {path} not found", file=sys.stderr)
            return 2
        namespace = runpy.run_path(str(path), run_name="tierstack_recipe")
        fns = [v for k, v in namespace.items() if k.endswith("_config") and callable(v) and k != "gpt_config"]
        if len(fns) != 1:
            print(f"tierstack pretrain: {path} must define exactly one *_config() function", file=sys.stderr)
            return 2
        config_fn = fns[0]
    else:
        from tierstack.recipes import gpt_config

        def config_fn():
            return gpt_config(
                "gpt_tiny", num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                train_iters=200, micro_batch_size=8, global_batch_size=8, lr=3e-3,
            )

    return run(config_fn, args.overrides)


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
        f"{stats.num_tokens} tokens ({stats.dtype}) from {stats.num_files} file(s) in {stats.seconds:.1f} s"
    )
    return 0


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    from tierstack.checkpointing import inspect as ckpt_inspect

    fn = {"ls": ckpt_inspect.ls, "verify": ckpt_inspect.verify}[args.action]
    text, status = fn(args.path)
    print(text)
    return status


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="tierstack", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    pt = sub.add_parser("pretrain", help="pretrain (gpt_tiny recipe unless --recipe is given)")
    pt.add_argument("--recipe", help="a recipe file defining one *_config() function")
    pt.add_argument("overrides", nargs="*", help="section.field=value overrides")
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
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
