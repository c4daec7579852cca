"""FSDP2 sharding as ``lit_spec.strategies`` applies it, on a process group of one (gloo): the units' mixed precision
(what the precision policy says they gather in) and ``whole_parameters`` leaving every unit as it found it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lit_spec.precision import fsdp_mixed_precision, precision_policy
from lit_spec.strategies import FSDPStrategy, fully_shard_model, whole_parameters, whole_weights
from random_models import random_model


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def sharded(precision: str, mesh) -> torch.nn.Module:
    model = random_model("llama")
    fully_shard_model(model, mesh, fsdp_mixed_precision(precision_policy(FSDPStrategy, precision)))
    return model


def layer_dtypes(model, ids: torch.Tensor) -> set[torch.dtype]:
    """The dtypes of the decoder layers' weights inside their forward (FSDP has gathered them by then)."""
    seen = set()
    hooks = [layer.register_forward_pre_hook(lambda m, _: seen.update(p.dtype for p in m.parameters()))
             for layer in model.model.layers]
    model(ids)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("precision, gathered", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_units_gather_in_the_compute_dtype_and_keep_fp32_shards(mesh, precision, gathered):
    model = sharded(precision, mesh)
    assert layer_dtypes(model, torch.tensor([[1, 2, 3]])) == {gathered}    # half the traffic under bf16-mixed
    model.reshard()
    assert {p.dtype for p in model.parameters()} == {torch.float32}        # the shards the optimizer steps


def reshards_after_forward(model) -> dict[str, bool]:
    """Per FSDP unit, whether a forward leaves its weights sharded (the root's: the embeddings, norm and LM head)."""
    model(torch.tensor([[1, 2, 3]]))
    return {"root": isinstance(model.get_input_embeddings().weight, DTensor)} | {
        f"layer {i}": isinstance(layer.self_attn.q_proj.weight, DTensor) for i, layer in enumerate(model.model.layers)}


def test_whole_parameters_leaves_every_unit_as_it_found_it(mesh):
    model = sharded("32-true", mesh)
    before = reshards_after_forward(model)
    assert before == {"root": False, "layer 0": True, "layer 1": True}, "FSDP's default: the root stays whole"
    with whole_parameters(model):
        model(torch.tensor([[1, 2, 3]]))        # a forward inside leaves them whole
        assert not isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    assert reshards_after_forward(model) == before


def test_whole_weights_after_a_forward_are_the_state_dicts_own(mesh):
    """After a forward FSDP2 leaves the root whole, its parameters plain tensors; ``whole_weights`` (what the export
    takes) reshards first, so it yields the very parameters the state dict holds, whole."""
    full = random_model("llama").state_dict()
    model = sharded("32-true", mesh)
    model(torch.tensor([[1, 2, 3]]))
    taken = {name: (param, tensor.clone()) for name, param, tensor in whole_weights(model)}
    state = model.state_dict(keep_vars=True)
    assert taken.keys() == state.keys() == full.keys()
    assert all(taken[k][0] is state[k] and torch.equal(taken[k][1], full[k]) for k in state)
