"""Llama tiny: gpt_tiny's size in the Llama shape (RMSNorm, SwiGLU, grouped-query attention, RoPE,
untied output layer, no biases), byte tokenizer, TP=2 on 2 ranks.

Run: ``python recipes/llama_tiny.py --nproc-per-node 2 [section.field=value ...]`` (validates, then
launches the ranks), or ``torchrun --nproc-per-node 2 recipes/llama_tiny.py [section.field=value ...]``.
The config is :func:`tierstack.recipes.llama_tiny.llama_tiny_config`, the same as ``tierstack pretrain llama_tiny``.
"""

from tierstack.recipes import llama_tiny_config, run

if __name__ == "__main__":
    raise SystemExit(run(llama_tiny_config))
