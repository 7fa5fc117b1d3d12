"""GPT small: 12 layers, hidden 768, 12 heads, sequence 1024 (GPT-2 small shape), for GPUs.

Run: ``torchrun --nproc-per-node 8 recipes/gpt_small.py [section.field=value ...]``.
The config is :func:`tierstack.recipes.gpt_small.gpt_small_config`, the same as ``tierstack pretrain gpt_small``.
"""

from tierstack.recipes import gpt_small_config, run

if __name__ == "__main__":
    raise SystemExit(run(gpt_small_config))
