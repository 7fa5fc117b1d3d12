"""Manifests record transformer_impl and bf16; a load across them is refused naming the setting,
except a GLOBAL weights-only load across bf16 (weights are cast)."""

import logging

import pytest

from tierstack.checkpointing import manifest, model_settings as compat
from tierstack.checkpointing.global_reader import CheckpointLoadError


def _manifest(**settings) -> dict:
    return manifest.build_manifest(tier="global", step=4, run_id="r", topology={}, train_state={}, files={},
                                   **settings)


FP32_LOCAL = {"transformer_impl": "local", "bf16": False}
BF16_LOCAL = {"transformer_impl": "local", "bf16": True}


@pytest.mark.parametrize("saved,now", [(FP32_LOCAL, BF16_LOCAL), (BF16_LOCAL, FP32_LOCAL)])
def test_resume_with_optimizer_across_bf16_names_the_setting(saved, now):
    with pytest.raises(CheckpointLoadError) as err:
        compat.check_load(_manifest(**saved), now, optim=True, where="ckpt/iter_0000004")
    msg = str(err.value)
    want = str(saved["bf16"]).lower()
    assert f"written with model.bf16={want}" in msg and f"set model.bf16={want} to resume it" in msg
    assert "checkpoint.load_optim=false" in msg and "ckpt/iter_0000004" in msg


@pytest.mark.parametrize("saved,now", [(FP32_LOCAL, BF16_LOCAL), (BF16_LOCAL, FP32_LOCAL)])
def test_global_weights_only_load_across_bf16_is_allowed_with_a_warning(saved, now, caplog):
    caplog.set_level(logging.WARNING, logger="tierstack.checkpointing.model_settings")
    compat.check_load(_manifest(**saved), now, optim=False, where="ckpt/iter_0000004")
    assert "cast to this run's dtype" in caplog.text


def test_local_tier_refuses_bf16_change_even_weights_only():
    with pytest.raises(CheckpointLoadError, match="LOCAL checkpoint .* set model.bf16=false to resume it"):
        compat.check_load(_manifest(**FP32_LOCAL), BF16_LOCAL, optim=False, where="loc/0/x.pt", casts_weights=False)


@pytest.mark.parametrize("saved,now", [("transformer_engine", "local"), ("local", "transformer_engine")])
def test_transformer_impl_change_is_refused_naming_the_setting(saved, now):
    with pytest.raises(CheckpointLoadError) as err:
        compat.check_load(_manifest(transformer_impl=saved, bf16=True), {"transformer_impl": now, "bf16": True},
                          optim=False, where="ckpt")
    assert f"set model.transformer_impl={saved}" in str(err.value)
    assert ("needs transformer-engine and a GPU" in str(err.value)) == (saved == "transformer_engine")


def test_same_settings_and_older_manifests_load():
    compat.check_load(_manifest(**BF16_LOCAL), BF16_LOCAL, optim=True, where="ckpt")
    compat.check_load(_manifest(), BF16_LOCAL, optim=True, where="ckpt")  # written before the fields existed


def test_transformer_impl_of_a_local_spec_model_is_local():
    import torch

    assert compat.transformer_impl_of([torch.nn.Sequential(torch.nn.Linear(2, 2))]) == "local"


def test_bf16_is_read_from_the_model_parameters():
    import torch

    fp32 = torch.nn.Linear(2, 2)
    assert compat.model_settings([fp32]) == {"transformer_impl": "local", "bf16": False}
    assert compat.model_settings([fp32.to(torch.bfloat16)])["bf16"] is True
