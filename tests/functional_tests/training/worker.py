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
    cfg.logger.loss_curve = False  # 0.6 s of matplotlib per launch; the main job and mlflow tests check the image
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

    sigterm_at = int(os.environ.get("TIERSTACK_TEST_SIGTERM_AT", "0"))
    # Faults of the non-finite guard tests, on rank 1 only, at one step:
    inf_grad_at = int(os.environ.get("TIERSTACK_TEST_INF_GRAD_AT", "0"))  # gradients the optimizer applies
    inf_loss_at = int(os.environ.get("TIERSTACK_TEST_INF_LOSS_AT", "0"))  # the loss report only (transient)
    inf_param_at = int(os.environ.get("TIERSTACK_TEST_INF_PARAM_AT", "0"))  # a parameter, after the step's update
    raise_at = int(os.environ.get("TIERSTACK_TEST_RAISE_AT", "0"))  # an error of rank 1's own, in that step's forward
    # Validation loss goes down, then up: from this step on, each step adds noise to the weights.
    noise_from = int(os.environ.get("TIERSTACK_TEST_NOISE_FROM", "0"))
    rank = int(os.environ.get("RANK", "0"))  # a plain `python` launch is a 1-rank run
    captured = {"done": 0}

    def on_step(ts, result):
        captured["done"] = ts.step
        if ts.step == sigterm_at and rank == 1:
            # A pre-emption notice that reaches one rank only.
            os.kill(os.getpid(), signal.SIGTERM)
        if ts.step == inf_param_at and rank == 1:  # after the update, before this step's checkpoints
            import torch

            with torch.no_grad():
                next(captured["model"].parameters()).view(-1)[0] = float("inf")
        if noise_from and ts.step >= noise_from:
            import torch

            gen = torch.Generator().manual_seed(ts.step)  # the same noise on every rank and run
            with torch.no_grad():
                for p in captured["model"].parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05 * (ts.step - noise_from + 1))
        if cfg.checkpoint.keep_best_k:  # what the last boundary left: the live records, the best tracker
            tracker = Path(cfg.checkpoint.save) / "best_checkpointed_iteration.txt"
            record.setdefault("best_seen", {})[ts.step] = {
                "records": [list(r) for r in ts.best_checkpoints],
                "tracker": tracker.read_text().strip() if tracker.exists() else None,
            }
        record["steps"].append(ts.step)
        record["losses"].append(result.loss)
        record["grad_norms"].append(result.grad_norm)

    def inject_inf_grad(model):
        """After the gradient all-reduce of step ``inf_grad_at`` and before the optimizer step,
        rank 1's gradients hold an inf: the optimizer applies it there (fp32, no loss scaler)."""
        finish = model.finish_grad_sync

        def finish_then_poison(*args, **kwargs):
            out = finish(*args, **kwargs)
            if captured["done"] + 1 == inf_grad_at and rank == 1:
                next(model.parameters()).main_grad.view(-1)[0] = float("inf")
            return out

        model.finish_grad_sync = finish_then_poison

    def forward_step(data_iterator, model):
        from tierstack.training.forward import gpt_forward_step

        if "model" not in captured and inf_grad_at:
            inject_inf_grad(model)
        captured["model"] = model
        if captured["done"] + 1 == raise_at and rank == 1 and model.training:
            raise RuntimeError(f"injected: an error of rank 1 only, in the forward of step {raise_at}")
        output, loss_func = gpt_forward_step(data_iterator, model)
        if captured["done"] + 1 != inf_loss_at or rank != 1 or not model.training:
            return output, loss_func

        def inf_report(output_tensor):
            loss, n, report = loss_func(output_tensor)
            return loss, n, {"lm loss": report["lm loss"] * float("inf")}

        return output, inf_report

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
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    from tierstack.runtime import process_exiting

    process_exiting()  # skip the final GC pass over torch's objects (0.7 s per rank)
