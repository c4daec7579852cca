"""Frozen-base training (lit_spec.methods.frozen_base): through Lightning's own loop, every method that trains a
part against a frozen base leaves the base bit-identical and changes only its part."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import MICRO_MODEL, built_method
from test_eagle3 import EAGLE3

# draft_distill's student: the teacher's own first layer (model.keep_layers), its other weights included
FIRST_LAYER = ["model@method.student=tiny", "+method.student.keep_layers=1",
               *(o.replace("model.", "method.student.", 1) for o in MICRO_MODEL[1:])]
METHODS = {
    "chimera": ["method=chimera", "method.shared_lm_head=true"],
    "medusa": ["method=medusa"],
    "hidden_transfer": ["method=hidden_transfer", "method.layers=[1,2]", "method.tree=[2,1]"],
    "draft_distill": ["method=draft_distill", *FIRST_LAYER],
    "eagle3": EAGLE3,
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_base_is_bit_identical_after_training(micro_config, method):
    module, datamodule = built_method(micro_config(*METHODS[method]))
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    part = getattr(module, module.exported)
    trained = {k: v.clone() for k, v in part.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 3
    after = module.model.state_dict()
    assert after.keys() == base.keys() and all(torch.equal(after[k], v) for k, v in base.items())
    assert any(not torch.equal(v, trained[k]) for k, v in part.state_dict().items())


def test_a_student_from_the_first_layers_starts_as_the_teachers_weights(micro_config):
    module, _ = built_method(micro_config(*METHODS["draft_distill"]))
    student, teacher = module.student.state_dict(), module.model.state_dict()
    assert len(module.student.model.layers) == 1 < len(module.model.model.layers)
    assert all(torch.equal(v, teacher[k]) for k, v in student.items())
