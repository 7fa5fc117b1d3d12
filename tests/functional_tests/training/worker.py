"""Worker for the training functional tests: pretrain a tiny GPT and record what each rank saw.

Usage: torchrun --nproc-per-node 2 worker.py OUT_DIR [section.field=value ...]
Writes OUT_DIR/rank<R>.json: per-step losses and grad norms, the final TrainState, a checksum of
this rank's parameters.
"""

import json
import os
import signal
import sys
from pathlib import Path


from tierstack.config import ConfigContainer
from tierstack.recipes import gpt_config


def tiny_config(out_dir: Path) -> ConfigContainer:
    cfg = gpt_config(
        "tiny",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        train_iters=30,
        micro_batch_size=4,
        global_batch_size=8,
        lr=3e-3,
        run_root=str(out_dir),
    )
    cfg.train.eval_interval = 10
    cfg.train.eval_iters = 2
    cfg.logger.log_interval = 5
    cfg.logger.progress_bar = False
    cfg.checkpoint.save = None
    cfg.checkpoint.save_interval = None
    cfg.checkpoint.local_dir = None
    cfg.checkpoint.local_save_interval = None
    cfg.straggler = None
    cfg.mlflow = None
    cfg.dataset.cache_dir = os.environ.get("TIERSTACK_TEST_CACHE", str(out_dir / "cache"))
    return cfg


def main() -> None:
    from tierstack import pretrain

    out_dir = Path(sys.argv[1])
    cfg = tiny_config(out_dir).apply_overrides(sys.argv[2:])
    record = {"losses": [], "grad_norms": [], "steps": []}

    poison_at = int(os.environ.get("TIERSTACK_TEST_NAN_GRAD_AT", "0"))
    sigterm_at = int(os.environ.get("TIERSTACK_TEST_SIGTERM_AT", "0"))

    def on_step(ts, result):
        if ts.step == poison_at and int(os.environ["RANK"]) == 1:
            # A non-finite gradient on one rank only, after the step and before the checkpoint.
            p = next(captured["model"].parameters())
            p.main_grad.view(-1)[0] = float("nan")
        if ts.step == sigterm_at and int(os.environ["RANK"]) == 1:
            # A pre-emption notice that reaches one rank only.
            os.kill(os.getpid(), signal.SIGTERM)
        record["steps"].append(ts.step)
        record["losses"].append(result.loss)
        record["grad_norms"].append(result.grad_norm)

    captured = {}

    def forward_step(data_iterator, model):
        from tierstack.training.forward import gpt_forward_step

        captured["model"] = model
        return gpt_forward_step(data_iterator, model)

    state = pretrain(cfg, forward_step, on_step=on_step)
    params = [p.detach().double() for p in captured["model"].parameters()]
    record["param_sum"] = float(sum(p.sum() for p in params))
    record["param_sq_sum"] = float(sum((p * p).sum() for p in params))
    record["train_state"] = state.state_dict()
    # Tied embeddings: the first stage's input embedding and the last stage's output layer.
    named = dict(captured["model"].named_parameters())
    for key, name in (("embedding_sum", "word_embeddings.weight"), ("output_layer_sum", "output_layer.weight")):
        match = [p for n, p in named.items() if n.endswith(name)]
        record[key] = float(match[0].detach().double().sum()) if match else None
    rank = int(os.environ["RANK"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
