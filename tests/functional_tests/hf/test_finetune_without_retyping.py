"""HF directory -> ``convert import`` -> ``pretrain llama_tiny checkpoint.pretrained_checkpoint=<it>``
with no ``model.*`` or ``tokenizer.*`` override: the architecture and tokenizer come from the
checkpoint, and the first loss is the HF model's. A conflicting override is refused, paste-ready."""

import json
import sys
from pathlib import Path

import pytest
import torch
from launcher import run_group

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit_tests" / "hf"))
import tiny_hf  # noqa: E402

DOC_WORDS = 15  # + the end-of-document token: 16 tokens, so every 256-token sample starts on a document


def _tierstack(*args, timeout=300):
    return run_group([sys.executable, "-m", "tierstack.cli", *map(str, args)], timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_finetune_from_an_import_takes_its_architecture_and_starts_at_the_hf_loss(tmp_path):
    hf = tiny_hf.build_model("llama")
    tiny_hf.save_model("llama", tmp_path / "hf")
    # Identical documents: every sample of llama_tiny's sequence (256) is the same window, whatever the order.
    doc = " ".join(f"w{i}" for i in range(1, DOC_WORDS + 1))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for _ in range(3000)))
    _ok(_tierstack("preprocess", "--input", tmp_path / "docs.jsonl", "--output-prefix", tmp_path / "docs",
                   "--tokenizer-type", "huggingface", "--tokenizer-path", tmp_path / "hf" / "tokenizer.json"))
    _ok(_tierstack("convert", "import", "--hf-path", tmp_path / "hf", "--save", tmp_path / "ckpt", "--tp", 2))

    run = tmp_path / "run"
    common = [f"checkpoint.pretrained_checkpoint={tmp_path / 'ckpt'}", f"dataset.data_path={tmp_path / 'docs'}",
              f"logger.run_dir={run}", f"dataset.cache_dir={tmp_path / 'cache'}"]
    log = _ok(_tierstack("pretrain", "llama_tiny", "--nproc-per-node", 2, *common, "train.train_iters=1",
                         "train.eval_interval=null", "logger.log_interval=1", "logger.progress_bar=false",
                         "logger.loss_curve=false", "mlflow=null", "straggler=null", "checkpoint.save=null",
                         "checkpoint.save_interval=null", "checkpoint.local_dir=null",
                         "checkpoint.local_save_interval=null", timeout=400))
    assert "loaded pretrained weights of step 0" in log
    assert "architecture and tokenizer taken from it" in log and "model.hidden_size=64" in log
    loss = next(json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line)

    stream = torch.tensor(([*range(1, DOC_WORDS + 1), 0] * 17)[:257])  # ids w1..w15, then <|endoftext|> = 0
    with torch.no_grad():
        logits = hf(stream[None, :256]).logits[0]
    hf_loss = float(torch.nn.functional.cross_entropy(logits, stream[1:257]))
    assert abs(loss - hf_loss) < 1e-4, (loss, hf_loss)
    # a model initialised from scratch starts near ln V = 4.85 (0.32 away here): the weights were the HF model's
    assert abs(hf_loss - torch.log(torch.tensor(128.0)).item()) > 0.1

    # A field given with another value than the checkpoint's is refused before any rank starts.
    refused = _tierstack("pretrain", "llama_tiny", "--nproc-per-node", 2, *common, "model.num_layers=4",
                         "tokenizer.tokenizer_type=byte", "--dry-run", timeout=120)
    assert refused.returncode == 2
    assert "model.num_layers=4 was given, but checkpoint.pretrained_checkpoint=" in refused.stderr
    assert ("use (or leave these fields out: they come from the checkpoint): model.num_layers=2 "
            "tokenizer.tokenizer_type=huggingface") in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("damaged, said", [
    ("*.safetensors", "import failed"),  # read by the import on rank 0
    ("config.json", "config.json cannot be read"),  # read before any rank starts (the fields to adopt)
    ("tokenizer.json", "is not a readable tokenizer.json"),  # read by every rank at setup
])
def test_a_damaged_hugging_face_directory_is_refused_like_bad_input(tmp_path, damaged, said):
    """One file of the directory cut short: the launch ends as a refusal does (status 2, the reason
    naming the file on the last line, no traceback), not a crash; nothing is left that changes the
    next launch. Found by trying: config.json and tokenizer.json gave tracebacks and status 1."""
    tiny_hf.save_model("llama", tmp_path / "hf")
    victim = next((tmp_path / "hf").glob(damaged))
    victim.write_bytes(victim.read_bytes()[:100])  # cut short
    run = tmp_path / "run"
    proc = _tierstack("pretrain", "llama_tiny", "--nproc-per-node", 2, f"checkpoint.pretrained_checkpoint={tmp_path / 'hf'}",
                      "dataset.mock=true", f"logger.run_dir={run}", "train.train_iters=1", "train.eval_interval=null",
                      "mlflow=null", "straggler=null", timeout=400)
    err = proc.stderr
    assert proc.returncode == 2, (proc.stdout + err)[-6000:]
    assert "Traceback" not in proc.stdout + err, err[-6000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert said in last and (victim.name in last or damaged.startswith("*")), err[-3000:]
    assert not list(run.rglob("run.json")) if run.exists() else True
