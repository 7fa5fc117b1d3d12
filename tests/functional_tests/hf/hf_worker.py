"""Worker for the Hugging Face functional tests (torchrun, gloo).

Usage:
  hf_worker.py logits STEP_DIR TP PP TOKENS_JSON OUT_JSON [NEW_ROOT]
      logits of the checkpoint at TP/PP; with NEW_ROOT, then publish the loaded model again there
      (files written by this TP/PP layout)
  hf_worker.py finetune HF_DIR TP RUN_DIR                   pretrain 1 step from the HF directory; record batch + loss
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _cfg(step_dir, tp, pp):
    from tierstack.config import DistributedConfig
    from tierstack.hf import checkpoint_io

    cfg = checkpoint_io.read_run_config(Path(step_dir))
    d = DistributedConfig(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp))
    return dataclasses.replace(cfg, distributed=d, mlflow=None, straggler=None)


def logits(step_dir, tp, pp, tokens_json, out_json, new_root=None):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from tierstack.checkpointing.state import unwrap
    from tierstack.hf import checkpoint_io

    cfg = _cfg(step_dir, tp, pp)
    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with checkpoint_io.parallel_world(cfg):
        objs = checkpoint_io.load_model_weights(cfg, Path(step_dir))
        model = unwrap(objs.model[0])
        with torch.no_grad():
            if not ps.is_pipeline_first_stage():
                hidden = torch.empty(tokens.shape[1], tokens.shape[0], cfg.model.hidden_size)
                dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model(tokens, pos, None)
            if not ps.is_pipeline_last_stage():
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            else:
                out = tensor_parallel.gather_from_tensor_model_parallel_region(out.contiguous())
                if ps.get_tensor_model_parallel_rank() == 0:
                    Path(out_json).write_text(json.dumps(out.tolist()))
        if new_root:
            checkpoint_io.save_global(cfg, objs, Path(new_root))


def finetune(hf_dir, tp, run_dir):
    from tierstack import pretrain
    from tierstack.config import CheckpointConfig, LoggerConfig, TrainConfig
    from tierstack.hf.convert import check_tokenizer, read_hf_config, run_config_for_hf
    from tierstack.training.forward import gpt_forward_step

    _c, _a, fields = read_hf_config(hf_dir)
    cfg = run_config_for_hf(fields, check_tokenizer(Path(hf_dir), fields["vocab_size"]), int(tp), 1)
    cfg = dataclasses.replace(
        cfg, mlflow=None, straggler=None,
        train=TrainConfig(train_iters=1, micro_batch_size=2, global_batch_size=2, eval_interval=None),
        logger=LoggerConfig(run_dir=run_dir, progress_bar=False),
        checkpoint=CheckpointConfig(pretrained_checkpoint=hf_dir),
    )
    cfg.model.seq_length = 32
    cfg.dataset.mock = True
    cfg.dataset.cache_dir = str(Path(run_dir) / "cache")
    record = {}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        record.setdefault("batch", {k: batch[k].tolist() for k in ("tokens", "labels", "loss_mask")})
        return gpt_forward_step(iter([batch]), model)

    def on_step(ts, result):
        record.setdefault("loss", result.loss)

    pretrain(cfg, forward_step, on_step=on_step)
    if int(os.environ["RANK"]) == 0:
        (Path(run_dir) / "record.json").write_text(json.dumps(record))


if __name__ == "__main__":
    {"logits": logits, "finetune": finetune}[sys.argv[1]](*sys.argv[2:])
    from tierstack.runtime import process_exiting

    process_exiting()  # skip the final GC pass over torch's objects (0.7 s per rank)
