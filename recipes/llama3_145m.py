"""Llama 3 145M, for GPUs: the Llama-3-shaped model of Megatron-Bridge's functional tests
(``Llama3ModelProvider145M``: 2 layers, hidden 768, MLP 2688, 16 query heads in 8 groups, RoPE base
500000, RMSNorm epsilon 1e-5, untied output layer, init std 0.01), sequence 8192.

Run: ``python recipes/llama3_145m.py --nproc-per-node 8 [section.field=value ...]`` (validates, then
launches the ranks), or ``torchrun --nproc-per-node 8 recipes/llama3_145m.py [section.field=value ...]``.
The config is :func:`tierstack.recipes.llama3_145m.llama3_145m_config`, the same as ``tierstack pretrain llama3_145m``.
"""

from tierstack.recipes import llama3_145m_config, run

if __name__ == "__main__":
    raise SystemExit(run(llama3_145m_config))
