"""Imported HF checkpoints at TP=2 and PP=2 on 2 ranks (gloo): logits equal HF's, a TP=2-written checkpoint
exports the same tensors, and fine-tuning from an HF directory starts at the HF model's loss."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit_tests" / "hf"))
import tiny_hf  # noqa: E402

WORKER = Path(__file__).with_name("hf_worker.py")


def _ok(proc):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stderr


@pytest.mark.slow
def test_llama_at_tp2_and_pp2_matches_hf_and_tp2_files_export_identically(tmp_path, torchrun):
    from transformers import AutoModelForCausalLM

    from tierstack.hf import export_hf, import_hf

    hf = tiny_hf.build_model("llama")
    tiny_hf.save_model("llama", tmp_path / "hf")
    step = import_hf(tmp_path / "hf", tmp_path / "ckpt", tensor_model_parallel_size=2)
    tokens = tiny_hf.sample_tokens(hf.config.vocab_size)
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    with torch.no_grad():
        ref = hf(tokens).logits
    for tp, pp in ((2, 1), (1, 2)):
        out = tmp_path / f"logits_tp{tp}_pp{pp}.json"
        resave = [tmp_path / "tp2"] if tp == 2 else []  # the TP=2 job also publishes the model it loaded
        _ok(torchrun([WORKER, "logits", step, tp, pp, tmp_path / "tokens.json", out, *resave], timeout=300))
        ours = torch.tensor(json.loads(out.read_text()))[..., : hf.config.vocab_size]
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5, msg=f"TP={tp} PP={pp}")

    # Files written by a TP=2 job (each rank its shards) export the tensors of the TP=1 model, bit for bit.
    out = export_hf(tmp_path / "tp2", tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


@pytest.mark.slow
def test_finetuning_from_an_hf_directory_starts_at_the_hf_loss(tmp_path, torchrun):
    hf = tiny_hf.build_model("llama")
    tiny_hf.save_model("llama", tmp_path / "hf")
    log = _ok(torchrun([WORKER, "finetune", tmp_path / "hf", 2, tmp_path / "run"], timeout=400))
    assert "loaded pretrained weights of step 0" in log
    rec = json.loads((tmp_path / "run" / "record.json").read_text())
    tokens, labels = torch.tensor(rec["batch"]["tokens"]), torch.tensor(rec["batch"]["labels"])
    mask = torch.tensor(rec["batch"]["loss_mask"]).float()
    with torch.no_grad():
        logits = hf(tokens).logits
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    hf_loss = float((per_token * mask).sum() / mask.sum())
    assert abs(rec["loss"] - hf_loss) < 1e-4, (rec["loss"], hf_loss)
    assert hf_loss < 20 and abs(hf_loss - torch.log(torch.tensor(128.0)).item()) > 0.5  # not a random model's ln V
