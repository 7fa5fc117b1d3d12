"""GPT tiny (the main job): 4 layers, hidden 256, 8 heads, sequence 256, byte tokenizer, TP=2 on 2 ranks.

Run: ``python recipes/gpt_tiny.py --nproc-per-node 2 [section.field=value ...]`` (validates, then
launches the ranks), or ``torchrun --nproc-per-node 2 recipes/gpt_tiny.py [section.field=value ...]``.
The config is :func:`tierstack.recipes.gpt_tiny.gpt_tiny_config`, the same as ``tierstack pretrain gpt_tiny``.
"""

from tierstack.recipes import gpt_tiny_config, run

if __name__ == "__main__":
    raise SystemExit(run(gpt_tiny_config))
