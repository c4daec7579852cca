"""Draft heads (Chimera, Medusa), methods part (the models/ and decoding/ files of this name build them and decode
with them): ``method=chimera`` and ``method=medusa``, draft heads trained on a frozen base (Chimera §4.2; Medusa-1).

Every batch runs the frozen base once, without gradient, for its last hidden states H_LLM and its own next-token
predictions; the heads are trained on them:

    L = w_nw · L_next_word + w_distill · L_distill                                   (Chimera eq. 7, weighted)
    L_next_word = sum_k CE(p_k(n), y_{n+2+k})   over answer tokens                  (eq. 5; Medusa-1 the same)
    L_distill   = mean_k MSE(h_full_{n+1+k}, h_LLM_{n+1+k})                         (eq. 6; Chimera only)

Labels ``labels=base`` (self-distillation, the default): y_{n+2+k} is the base's greedy token after the true prefix
x_<=n+1+k — what verification accepts; ``labels=data``: the dataset's token. Validation logs each head's top-1..5
accuracy (Table 5's metric) and loss. Only the heads are trainable, checkpointed and exported (safetensors + a
config naming the base: ``lit_spec.models.saved_heads.save_heads``), with the counts of the labels they were trained on
(``token_counts``: FR-Spec's ranking for ``draft_vocab``); ``decoders()`` offers the tree decoder they draft for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_spec.data import IGNORE_INDEX
from lit_spec.decoding.draft_heads import ChimeraDecoder, MedusaDecoder
from lit_spec.decoding.tree import TreeSpec
from lit_spec.errors import ConfigError, check_count
from lit_spec.methods.frozen_base import FrozenBaseModule
from lit_spec.models.chimera import ChimeraDraft
from lit_spec.models.draft_heads import DraftHeads, MedusaHeads

LABELS = ("base", "data")
TOP_K = (1, 2, 3, 4, 5)


def head_targets(input_ids: torch.Tensor, answer: torch.Tensor, base_next: torch.Tensor, k: int,
                 labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of head k at every prefix end n in [0, T-k-2) — token n+2+k — and where they count (answer tokens:
    ``answer`` marks them, padding excluded). ``base_next[:, t]``: the base's greedy token after x_<=t."""
    t = input_ids.size(1)
    target = base_next[:, k + 1: t - 1] if labels == "base" else input_ids[:, k + 2:]
    return target, answer[:, k + 2:]


def check_tree(tree, depth: int, what: str) -> list:
    """The static tree of a heads method's decoder, no deeper than the positions its heads draft."""
    spec = TreeSpec.parse(list(tree))
    if spec.depth > depth:
        raise ConfigError(f"method.tree is {spec.depth} deep but {what}: the heads draft {depth} positions")
    return list(tree)


class HeadsModule(FrozenBaseModule):
    """Shared by Chimera and Medusa. Args (besides ``MethodModule``'s):
        num_heads: K, the heads (positions drafted after the base's next token).
        labels: ``base`` (self-distillation) or ``data``.
        tree: the static tree of ``decoders()`` (top-k per depth, or Medusa-style paths); depth <= K.
        shared_lm_head: the heads project with the base's frozen LM head instead of their own trainable copies.
    """

    def __init__(self, model_spec, num_heads: int = 4, labels: str = "base", tree=(3, 2, 1, 1),
                 shared_lm_head: bool = False, **kwargs):
        check_count("method.num_heads", num_heads)
        if labels not in LABELS:
            raise ConfigError(f"method.labels={labels!r}: choose one of {list(LABELS)}")
        tree = check_tree(tree, num_heads, f"method.num_heads={num_heads}")
        super().__init__(model_spec, num_heads=num_heads, labels=labels, tree=tree,
                         shared_lm_head=bool(shared_lm_head), **kwargs)

    def build_heads(self, config) -> DraftHeads:
        raise NotImplementedError

    def build_trainable(self) -> DraftHeads:
        return self.build_heads(self.model.config).init_from_base(self.model)

    # ---- losses ---------------------------------------------------------------------------------------------
    def _base(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The frozen base's embeddings, last hidden states and greedy next tokens of the batch: its forward, or the
        states cached once by the ``base_states`` stage (``data.base_states.enabled``)."""
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(batch["input_ids"])
            if "base_hidden" in batch:
                return embeds, batch["base_hidden"].to(embeds.dtype), batch["base_next"]
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             output_hidden_states=True)
        return embeds, out.hidden_states[-1], out.logits.argmax(-1)

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        hp = self.hparams
        embeds, hidden, base_next = self._base(batch)
        valid = batch["attention_mask"].bool()
        answer = batch["labels"] != IGNORE_INDEX
        inputs, full = self.heads.head_inputs(embeds, hidden, valid)
        next_word, count = hidden.new_zeros(()), 0
        for k, head_inputs in enumerate(inputs):
            target, where = head_targets(batch["input_ids"], answer, base_next, k, hp.labels)
            n = int(where.sum())
            if n == 0:
                continue
            picked, labels = self.heads.heads[k](head_inputs[where]), target[where]   # logits of answer tokens only
            if stage == "train" and k == 0:
                self.heads.count_tokens(labels)                            # what draft_vocab (FR-Spec) ranks by
            loss_k = F.cross_entropy(picked.float(), labels)
            next_word = next_word + loss_k                                  # eq. 5: summed over heads
            count = max(count, n)
            if stage == "val":
                self.log(f"val/head{k}/loss", loss_k, batch_size=n, sync_dist=True)
                top = picked.topk(max(TOP_K), dim=-1).indices == labels[:, None]
                for t in TOP_K:
                    self.log(f"val/head{k}/top{t}", top[:, :t].any(-1).float().mean(), batch_size=n,
                             sync_dist=True)
        if count == 0:    # no answer token reaches any head: a zero loss that still has every head's gradient (0)
            next_word = sum(p.sum() for p in self.heads.parameters()) * 0.0
        loss = hp.next_word_weight * next_word
        self.log(f"{stage}/next_word", next_word, batch_size=max(count, 1), sync_dist=True)
        if full is not None:
            distill = self._distill(full, hidden, valid)
            loss = loss + hp.distill_weight * distill
            self.log(f"{stage}/distill", distill, batch_size=max(count, 1), sync_dist=True)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=max(count, 1), sync_dist=True)
        return loss

    @staticmethod
    def _distill(full: list[torch.Tensor], hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Eq. 6: MSE between ``h_full_{n+1+k}`` and ``h_LLM_{n+1+k}`` over real tokens, averaged over heads."""
        terms = []
        for k, state in enumerate(full):
            m = state.size(1)
            where = valid[:, k + 1: k + 1 + m]
            if where.any():
                terms.append(F.mse_loss(state[where].float(), hidden[:, k + 1: k + 1 + m][where].float()))
        return torch.stack(terms).mean() if terms else hidden.new_zeros(())


class ChimeraModule(HeadsModule):
    """Args (besides ``HeadsModule``'s): ngram (the n-gram encoder's n; 3 = trigram), residual (heads read
    h_LLM_n too; false = Fig. 8's ablation), attention_heads / ffn_size of the full-context block (null: the base's
    attention heads / 4·d), next_word_weight / distill_weight (eq. 7), ngram_cache (entries of the decoder's LRU
    n-gram cache)."""

    def __init__(self, model_spec, ngram: int = 3, residual: bool = True, attention_heads: int | None = None,
                 ffn_size: int | None = None, next_word_weight: float = 1.0, distill_weight: float = 1.0,
                 ngram_cache: int = 4096, **kwargs):
        super().__init__(model_spec, ngram=ngram, residual=residual, attention_heads=attention_heads,
                         ffn_size=ffn_size, next_word_weight=next_word_weight, distill_weight=distill_weight,
                         ngram_cache=ngram_cache, **kwargs)

    def build_heads(self, config) -> ChimeraDraft:
        hp = self.hparams
        return ChimeraDraft(config.hidden_size, config.vocab_size, hp.num_heads, hp.ngram, hp.residual,
                            hp.attention_heads or config.num_attention_heads, hp.ffn_size,
                            getattr(config, "rms_norm_eps", 1e-6), hp.shared_lm_head)

    def decoders(self, **sampling) -> dict:
        return {"chimera": ChimeraDecoder(self.model, self.heads, tree=self.hparams.tree,
                                          ngram_cache=self.hparams.ngram_cache, **sampling)}


class MedusaModule(HeadsModule):
    """Medusa-1 heads, the baseline of Chimera's Table 5 (same data, labels and budget)."""

    def __init__(self, model_spec, next_word_weight: float = 1.0, **kwargs):
        super().__init__(model_spec, next_word_weight=next_word_weight, **kwargs)

    def build_heads(self, config) -> MedusaHeads:
        return MedusaHeads(config.hidden_size, config.vocab_size, self.hparams.num_heads, self.hparams.shared_lm_head)

    def decoders(self, **sampling) -> dict:
        return {"medusa": MedusaDecoder(self.model, self.heads, tree=self.hparams.tree, **sampling)}
