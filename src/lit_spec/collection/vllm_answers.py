"""``collect.engine=vllm``: the target's own greedy answers (``collect.decoder=ar``, the data of EAGLE-3, Medusa and the
distilled draft) decoded by vLLM from its own environment (``lit_spec.serving.vllm_runner``), as SpecForge and
speculators regenerate their data with their serving engine. The same plan, records and atomic parts as the
lit_spec engine's (``collector.py``), written batch by batch as vLLM finishes them, so the same command resumes an
interrupted run. Afterwards ``collect.engine_check`` records are decoded again by transformers' ``generate``: a
record that differs is an error, since it would train the draft on answers that are not the target's."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from lit_spec.collection.collector import make_record
from lit_spec.data.trajectories import write_part
from lit_spec.decoding.state import eos_ids, until_eos
from lit_spec.errors import DataError
from lit_spec.precision import export_dtype
from lit_spec.serving.vllm_runner import vllm_answers

log = logging.getLogger(__name__)


def collect_with_vllm(model_spec, tokenizer, out: Path, todo: list[dict], c: DictConfig, repetition_filter) -> float:
    """Write every batch of ``todo`` as a part of ``out``; returns the seconds vLLM took, start-up included."""
    eos = eos_ids(tokenizer.eos_token_id)

    def write(i: int, answers: list[list[int]]) -> None:
        b = todo[i]
        write_part(out, b["split"], b["batch"], [
            make_record(b["split"], index, b["prompt_ids"][r], b["reference_ids"][r], until_eos(answers[r], eos), [],
                        {}, torch.Generator(), repetition_filter, tokenizer)
            for r, index in enumerate(b["index"])])

    start = time.perf_counter()
    # the dtype transformers loads (vLLM's own "auto" would run an fp32 model in half precision)
    dtype = str(export_dtype("auto", model_spec)).removeprefix("torch.")
    vllm_answers(model_spec.name_or_path, [b["prompt_ids"] for b in todo], c.max_new_tokens, write, dtype=dtype)
    return time.perf_counter() - start


@torch.no_grad()
def check_against_generate(model_spec, tokenizer, records: list[dict], max_new_tokens: int) -> None:
    """``records`` decoded again, one at a time, by transformers' greedy ``generate``; a DataError names the first
    whose answer differs."""
    if not records:
        return
    model = model_spec.load_model().eval()
    eos = eos_ids(tokenizer.eos_token_id)
    for record in records:
        ids = torch.tensor([record["prompt_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        theirs, ours = record["answer_ids"], until_eos(out[0, ids.size(1):].tolist(), eos)
        if ours != theirs:
            at = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
            raise DataError(f"collect.engine=vllm: record {record['id']}'s answer from vLLM differs from transformers' "
                            f"greedy generate at token {at}; these would not be the target's own answers: collect "
                            "with collect.engine=null (lit_spec's engine)")
    log.info("collect.engine=vllm: %d records checked against transformers' generate, all identical", len(records))
