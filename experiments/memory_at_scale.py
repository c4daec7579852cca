"""What the sharded path holds per GPU for the shipped 7B, 33B and 70B bases on 8×A100 80 GB, under ZeRO-3 in
bf16-mixed (the card's configuration): counted, not run.

Each method's trained part is built by its own ``build_models`` on the meta device beside a meta-device base of the
model's published architecture (its config.json: the hub is not reachable here), so the parameter counts are exact;
the bytes follow the precision policy (bf16 weights, fp32 masters: the ZeRO paper's 2 + 2 + 12 bytes per trained
parameter, 2 per frozen one) over N GPUs. Activations, communication buckets and fragmentation are left out.

    python experiments/memory_at_scale.py
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_spec.config import build, compose_config
from lit_spec.precision import PrecisionPolicy

# model config -> its config.json's architecture (all Llama-shaped, untied embeddings)
ARCHITECTURES = {
    "deepseek_coder_7b_instruct": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32256),
    "deepseek_coder_33b_instruct": dict(hidden_size=7168, intermediate_size=19200, num_hidden_layers=62,
                                        num_attention_heads=56, num_key_value_heads=8, vocab_size=32256),
    "llama2_chat_70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
}
METHODS = ["cllm", "chimera", "medusa", "hidden_transfer"]    # a full fine-tune, then three frozen-base methods
BF16 = PrecisionPolicy(trained=torch.bfloat16, masters=torch.float32, compute=torch.bfloat16)


def counts(model: str, method: str) -> dict[str, int]:
    """Parameters: frozen base, trained part, what the trained part's initialisation gathers (embeddings and LM
    head), and the largest decoder layer (what decoding through ZeRO-3's hooks holds whole at a time)."""
    cfg = compose_config([f"method={method}", f"model={model}"])
    module = build(cfg.method, model_spec=build(cfg.model))     # the spec loads nothing until asked
    module.policy = BF16
    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**ARCHITECTURES[model], tie_word_embeddings=False))
        if method == "cllm":
            module.model = base
        else:
            module.model = base.to(torch.bfloat16).requires_grad_(False)
            module.build_models()
    numel = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"frozen": numel(module) - trained, "trained": trained,
            "init_gather": numel(base.get_input_embeddings()) + numel(base.get_output_embeddings()),
            "layer": numel(base.model.layers[0])}


def per_gpu(c: dict[str, int], gpus: int, memory_gb: float) -> dict[str, str]:
    gb = lambda n: n / 1e9  # noqa: E731
    frozen, trained = c["frozen"], c["trained"]
    state = gb(2 * frozen + 16 * trained) / gpus
    copy = gb(2 * (frozen + trained))
    # decode_copy=auto takes the copy where it fits in 80% of what training leaves free
    decoding = (f"copy {copy:.1f}" if copy <= 0.8 * (memory_gb - state)
                else f"hooks {gb(2 * c['layer']):.1f} (copy {copy:.0f}: no)")
    full_finetune = frozen == 0
    return {
        "trained": f"{trained / 1e9:.2f}B",
        "state": f"{state:.1f}" + (f" (over {memory_gb:.0f}: ZeRO-3 offload)" if state > memory_gb else ""),
        "init": "—" if full_finetune else f"{gb(2 * c['init_gather']):.1f} (whole base: {gb(2 * frozen):.0f})",
        "decoding": decoding,
        "checkpoint": f"{gb(14 * trained):.1f}" + ("" if full_finetune else f" (with the base: "
                                                                             f"{gb(14 * trained + 2 * frozen):.0f})"),
        "export": f"{gb(2 * trained):.1f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--memory-gb", type=float, default=80.0)
    args = parser.parse_args()
    print("| base | method | trained Ψ | ZeRO-3 state per GPU, GB | initialising the trained part: gathered per GPU, "
          "GB | speedup callback per GPU, GB | checkpoint on disk, GB | export on rank 0 (bf16), GB |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ARCHITECTURES:
        for method in METHODS:
            row = per_gpu(counts(model, method), args.gpus, args.memory_gb)
            print(f"| {model} | {method} | " + " | ".join(row.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
