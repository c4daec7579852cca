"""Jacobi Forcing (method=jacobi_forcing, data=noisy_trajectories): the noise schedule and packed sequences of a
hand-written trajectory, the noise-aware mask position by position, the losses of one forward against separate
plain forwards on a micro model, bad settings, and training end to end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from closeness import assert_same_gradients
from conftest import MICRO_MODEL, make_config
from lit_spec.config import build
from lit_spec.data import IGNORE_INDEX, NoisyTrajectoryDataModule
from lit_spec.data.noisy_trajectories import (CLEAN, NOISY, noise_ratios, packed_item, pick_state, record_blocks,
                                              unconverged)
from lit_spec.decoding.masks import CONTEXT, PADDING, noise_aware
from lit_spec.errors import ConfigError
from lit_spec.methods import JacobiForcingModule
from lit_spec.training import run_training
from test_cllm import _logged, write_trajectories

X = IGNORE_INDEX


def test_schedule_and_state_choice():
    assert noise_ratios(5) == [0.0, 0.25, 0.5, 0.75, 1.0] and noise_ratios(1) == [0.0]
    fixed = [7, 8, 9, 10]
    assert [unconverged(s, fixed) for s in ([1, 8, 9, 10], [7, 1, 9, 10], [7, 8, 9, 10])] == [1.0, 0.75, 0.0]
    states = [[1, 2, 3, 4], [7, 2, 3, 4], [7, 8, 3, 4], [7, 8, 9, 10]]   # unconverged 1, 0.75, 0.5, 0
    assert pick_state(states, 0.0) == fixed
    assert pick_state(states, 0.6) == [7, 8, 3, 4]
    assert pick_state(states, 0.625) == [7, 2, 3, 4]                    # a tie: the noisier, earlier state
    assert pick_state(states, 1.0) == [1, 2, 3, 4]


def test_a_records_blocks_as_collected():
    record = {"blocks": [{"states": [[1, 2, 3, 4], [5, 2, 3, 4], [5, 6, 7, 8]]}, {"states": [[]]},
                         {"states": [[9, 9], [9, 10]]}]}
    assert record_blocks(record) == [[[1, 2, 3, 4], [5, 2, 3, 4], [5, 6, 7, 8]], [[9, 9], [9, 10]]]   # empty: out


def test_packed_sequence_of_a_known_record():
    # two blocks of 2 after a 2-token context; block 0 noisy from its 2nd token, block 1 from its 1st
    blocks = [[[5, 1], [5, 6]], [[2, 3], [7, 3], [7, 8]]]
    item = packed_item([40, 41], blocks, [pick_state(b, 1.0) for b in blocks])
    assert item["ids"] == [40, 41, 5, 1, 5, 6, 2, 3, 7, 8]
    assert item["positions"] == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    assert item["streams"] == [CONTEXT] * 2 + [NOISY] * 2 + [CLEAN] * 2 + [NOISY] * 2 + [CLEAN] * 2
    # the next answer token at the context's end and every clean position; nothing after the answer's last token
    assert item["labels"] == [X, 5, X, X, 6, 7, X, X, 8, X]
    # (noisy, clean, block) from each noisy block's first wrong token to its end (the answer's last position too,
    # as the authors' code keeps it); T = 2 blocks
    assert item["pairs"] == [(3, 5, 0), (6, 8, 1), (7, 9, 1)] and item["blocks"] == 2
    clean = packed_item([40, 41], blocks, [b[-1] for b in blocks])     # ratio 0: the fixed points, nothing to learn
    assert clean["ids"][2:4] == [5, 6] and clean["pairs"] == []


def test_noise_aware_mask_position_by_position():
    item = packed_item([40, 41], [[[5, 1], [5, 6]], [[2, 3], [7, 8]]], [[5, 1], [2, 3]])
    streams = torch.tensor([item["streams"] + [PADDING]])
    positions = torch.tensor([item["positions"] + [0]])
    expected = ["10000000000",   # context: causal
                "11000000000",
                "11100000000",   # k_0: the context, then causal in k_0
                "11110000000",
                "11001000000",   # l_0: the context, then causal in l_0 (never a noisy token)
                "11001100000",
                "11110010000",   # k_1: the context, all of k_0, causal in k_1
                "11110011000",
                "11001100100",   # l_1: the context, all of l_0, causal in l_1
                "11001100110",
                "00000000001"]   # padding: itself only
    got = noise_aware(streams, positions)[0].int().tolist()
    assert ["".join(map(str, row)) for row in got] == expected
    # packed CLLM: a noisy block reads the context, the clean blocks before it and itself (c + y)
    expected[6:8] = ["11001110000",  # k_1: the context, all of l_0, causal in k_1
                     "11001111000"]
    got = noise_aware(streams, positions, torch.tensor([item["block_ids"] + [-1]]))[0].int().tolist()
    assert ["".join(map(str, row)) for row in got] == expected
    assert item["block_ids"] == [-1, -1, 0, 0, 0, 0, 1, 1, 1, 1]


PAPER = {"consistency_reduction": "sum", "ar_prompt": False}


def _micro_module(ar_weight: float = 10.0, **settings) -> JacobiForcingModule:
    from random_models import random_model

    module = JacobiForcingModule(SimpleNamespace(to_dict=dict), n_tokens=2, ar_weight=ar_weight, **settings)
    module.model = random_model().train()
    module.log = lambda *a, **k: None
    return module


@pytest.mark.parametrize("paper", [False, True], ids=["authors_code", "paper"])
def test_losses_of_one_forward_equal_the_formulas_on_plain_forwards(paper):
    """The packed forward's logits are those of plain causal forwards of the clean answer and of the noisy stream,
    so both terms and their gradients can be written out from those, per record (the authors' trainer takes one
    record a step; the LM head runs only where a term reads, the hand version everywhere):
    the authors' code, Σ_pairs KL(clean ‖ noisy) / K / T and the AR cross-entropy over the prompt's and the answer's
    next tokens; or the paper's form, the mean over blocks of each block's Σ KL and the answer's AR term."""
    records = [(list(range(10, 14)), [[[20, 3], [20, 21]], [[4, 5], [22, 5], [22, 23]], [[6, 7], [24, 25]]]),
               ([30, 31], [[[32, 9], [32, 33]], [[8, 8], [34, 35]]])]
    dm = NoisyTrajectoryDataModule(path="unused")
    batch = dm.collate([packed_item(c, b, [pick_state(x, 1.0) for x in b]) for c, b in records])
    module = _micro_module(**(PAPER if paper else {}))
    consistency, ar = module._losses(batch)
    (consistency + 10.0 * ar).backward()
    model = module.model
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()

    per_record, per_block, ce = [], [], []
    for context, blocks in records:
        answer = [t for b in blocks for t in b[-1]]
        noisy_stream = [t for b in blocks for t in pick_state(b, 1.0)]
        clean = model(torch.tensor([context + answer])).logits[0]
        noisy = model(torch.tensor([context + noisy_stream])).logits[0]
        p, seq = len(context), context + answer
        ce += [F.cross_entropy(clean[t - 1], torch.tensor(seq[t])) for t in range(p if paper else 1, len(seq))]
        kls = []
        for j, states in enumerate(blocks):
            fixed, state = states[-1], pick_state(states, 1.0)
            first = next(t for t in range(2) if state[t] != fixed[t])
            block = []
            for t in range(first, 2):                        # to the block's end, the answer's last position too
                log_p, log_q = clean[p + 2 * j + t].detach().log_softmax(-1), noisy[p + 2 * j + t].log_softmax(-1)
                block.append((log_p.exp() * (log_p - log_q)).sum())
            kls += block
            per_block.append(sum(block))
        per_record.append(sum(kls) / len(kls) / len(blocks))
    expected = sum(per_block) / len(per_block) if paper else sum(per_record) / len(per_record)
    assert (consistency.item(), ar.item()) == pytest.approx([expected.item(), (sum(ce) / len(ce)).item()], rel=1e-4)
    (expected + 10.0 * sum(ce) / len(ce)).backward()
    assert_same_gradients(got, {k: p.grad for k, p in model.named_parameters()})
    assert module.training_step(batch, 0).item() == pytest.approx(consistency.item() + 10.0 * ar.item(), rel=1e-5)


def test_a_batch_without_pairs_still_has_an_ar_loss():
    dm = NoisyTrajectoryDataModule(path="unused")
    batch = dm.collate([packed_item([10, 11], [[[20, 21]]], [[20, 21]])])
    consistency, ar = _micro_module()._losses(batch)
    assert consistency.item() == 0.0 and consistency.requires_grad and math.isfinite(ar.item()) and ar.item() > 0


@pytest.mark.parametrize("kwargs, match", [
    ({"noise_window": 0}, r"^data.noise_window=0: must be an integer >= 1$"),
    ({"noise_schedule": "cosine"}, r"^data.noise_schedule='cosine': choose one of"),
    ({"ar_target": "dataset"}, r"^data.ar_target='dataset': Jacobi Forcing's AR loss reads the clean blocks")])
def test_bad_data_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NoisyTrajectoryDataModule(path="unused", **kwargs)


@pytest.mark.parametrize("kwargs, match", [({"n_tokens": 0}, "n_tokens"), ({"ar_weight": -1}, "ar_weight"),
                                           ({"blocks": 0}, "blocks"), ({"spawn_ratio": 2.0}, "spawn_ratio"),
                                           ({"distance": "l2"}, "distance"),
                                           ({"consistency_reduction": "sums"}, "consistency_reduction")])
def test_bad_method_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        JacobiForcingModule(None, **kwargs)


def _run(tmp_path, traj, method: str = "jacobi_forcing", data: str = "noisy_trajectories", *overrides):
    return make_config(tmp_path / "run", [
        *MICRO_MODEL, f"method={method}", f"data={data}", f"data.path={traj}", "data.batch_size=2",
        "method.n_tokens=3", "method.lr=3e-3", "method.warmup_steps=0", "trainer.max_steps=4",
        "trainer.val_check_interval=2", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1", "callbacks=default", "callbacks.throughput.window_size=2", *overrides])


def test_the_block_size_must_be_the_collected_one(tmp_path):
    traj = write_trajectories(tmp_path / "traj")            # collected with n = 3
    with pytest.raises(ConfigError, match=r"^method.n_tokens=2, but the trajectories at .* were collected with n=3: "
                                          r"set method.n_tokens=3, or collect with n=2"):
        run_training(_run(tmp_path, traj, "jacobi_forcing", "noisy_trajectories", "method.n_tokens=2"))
    assert not (tmp_path / "run").exists()


def test_method_and_data_must_match(tmp_path):
    traj = write_trajectories(tmp_path / "traj")
    with pytest.raises(ConfigError, match=r"JacobiForcingModule trains on NoisyTrajectoryDataModule batches.*"
                                          r"data=noisy_trajectories"):
        run_training(_run(tmp_path, traj, "jacobi_forcing", "trajectories"))
    with pytest.raises(ConfigError, match=r"CLLMModule trains on TrajectoryDataModule batches"):
        run_training(_run(tmp_path, traj, "cllm", "noisy_trajectories"))


def test_jacobi_forcing_trains_end_to_end(tmp_path):
    traj = write_trajectories(tmp_path / "traj", train=4)     # _record's blocks: 3 noisy states, then 1 fixed one
    dm = NoisyTrajectoryDataModule(path=str(traj), batch_size=2, noise_window=3)
    dm.setup()
    assert len(dm.items("train")) == 3                         # one item per record (4 records, 1 held out)
    first = next(iter(dm.train_dataloader()))
    # progressive: block 0 at ratio 0 is its fixed point, block 1 has no other state: nothing noisy to learn
    assert first["pairs"].numel() == 0 and (first["labels"] != X).sum().item() == 2 * 5

    cfg = _run(tmp_path, traj, "jacobi_forcing", "noisy_trajectories", "data.noise_window=2",
               "data.noise_schedule=random")
    metrics = run_training(cfg)
    assert metrics["global_step"] == 4
    run = tmp_path / "run"
    for key in ("train/consistency", "train/ar", "train/loss", "val/loss"):
        values = _logged(run, key)
        assert values and all(math.isfinite(v) and v >= 0 for v in values), (key, values)
    assert max(_logged(run, "train/consistency")) > 0          # some block 0 drew ratio 1: its noisy initial guess
    loss, cons, ar = (_logged(run, f"val/{k}")[0] for k in ("loss", "consistency", "ar"))
    assert loss == pytest.approx(cons + 10.0 * ar, rel=1e-4)   # ω = 10

    module = build(cfg.method, model_spec=build(cfg.model))
    module.configure_model()
    decoders = module.decoders()
    assert sorted(decoders) == ["jacobi", "multiblock"] and decoders["multiblock"].n_tokens == 3


def test_packed_cllm_draws_its_students_as_cllm_and_trains(tmp_path):
    """``noise_schedule=uniform``: each block's noisy state is one of CLLM's student states (augmented ones too),
    drawn anew each epoch; ``method=cllm_packed`` trains on those items end to end."""
    from lit_spec.data.trajectory_data import student_pool

    traj = write_trajectories(tmp_path / "traj", train=4)
    dm = NoisyTrajectoryDataModule(path=str(traj), noise_schedule="uniform")
    dm.setup()
    items, record = dm.items("train"), dm.records["train"][0]
    drawn = {tuple(items.noisy_states(record, 0, epoch)[0]) for epoch in range(12)}
    assert drawn == {tuple(state) for state, _ in student_pool(record["blocks"][0])}   # 3 states + 1 augmented
    assert items.noisy_states(record, 0, 5)[1] == [300, 301]                           # at its fixed point already

    metrics = run_training(_run(tmp_path, traj, "cllm_packed", "noisy_trajectories", "data.noise_schedule=uniform"))
    assert metrics["global_step"] == 4
    assert max(_logged(tmp_path / "run", "train/consistency")) > 0


def test_progressive_rounds_are_stages_in_order(tmp_path):
    """Round 2 trains round 1's export on round 1's own trajectories at n = 32: every step is a stage, listed (and
    built) before the run, each after the stages it needs."""
    from lit_spec.config import compose_config
    from lit_spec.stages import find_stages

    cfg = compose_config(["+experiment=jacobi_forcing_quickstart_round2", f"paths.cache_dir={tmp_path}"])
    stages = find_stages(cfg)
    assert [s.name.rsplit("-", 1)[0] for s in stages] == [
        "tiny_base", "tiny_target", "trajectories", "jacobi_forcing_quickstart", "trajectories"]
    assert all(s.output.parent == tmp_path for s in stages)                # one cache, the run's
    round1, collected = stages[3], stages[4]
    assert round1.config.method.n_tokens == 16 and collected.config.collect.n_tokens == 32
    assert collected.config.model.name_or_path == str(round1.output)       # collected by the round-1 model
    assert cfg.model.name_or_path == str(round1.output) and cfg.method.n_tokens == 32
    assert not any(tmp_path.iterdir())                                      # listed, nothing built


def test_a_cached_stage_needs_nothing_upstream(tmp_path):
    """With round 1's trajectories cached, round 2 needs none of the stages they were collected from (the tiny base,
    target and round-1 trajectories); with round 1's export cached but not its trajectories, only the collection runs.
    (Marked built by the files each kind checks; nothing is built.)"""
    from lit_spec.config import compose_config
    from lit_spec.data.trajectories import write_meta
    from lit_spec.stages import find_stages, needed

    def plan():
        named: list = []
        stages = find_stages(compose_config(["+experiment=jacobi_forcing_quickstart_round2",
                                             f"paths.cache_dir={tmp_path}"]), named)
        return [s.name.rsplit("-", 1)[0] for s in needed(stages, named)], stages

    names, stages = plan()
    assert names == ["tiny_base", "tiny_target", "trajectories", "jacobi_forcing_quickstart", "trajectories"]
    round1, collected = stages[3].output, stages[4].output
    round1.mkdir()
    (round1 / "config.json").write_text("{}")
    assert plan()[0] == ["jacobi_forcing_quickstart", "trajectories"]     # a collection by the cached round 1
    write_meta(collected, {}, complete=True)
    names, stages = plan()
    assert names == ["jacobi_forcing_quickstart", "trajectories"] and all(s.built() for s in stages[3:])
