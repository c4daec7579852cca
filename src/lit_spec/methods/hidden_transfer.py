"""Hidden Transfer, methods part (the models/ and decoding/ files of this name build and decode with the maps):
``method=hidden_transfer`` (Wu et al. 2024, §3.3), the transfer maps W_i trained on a frozen base.

One forward per batch feeds the real sequence (T tokens) followed by k pseudo tokens per real one
(``models.hidden_transfer.transfer_block``: pseudo (j, i) sees the real tokens <= j and its chain's steps <= i, at
position j+i; the hooks make it W_i · h_j at layer t_i). Real tokens never see pseudo ones, so their logits are the
frozen base's own and serve as the teacher:

    L = sum_i sum_j D(P_{j+i}, P̃_{j,i})      over answer positions (the token after j+i is an answer token)   (§3.3)

with D the forward KL by default (``distance``: forward_kl | reverse_kl | jsd, ``methods.losses``). Validation
logs each step's top-1..5 accuracy against the base's greedy token at j+i+1 and, with ``log_cosine``, the cosine
similarity between pseudo and real hidden states at every layer from t_i up (the paper's Fig. 4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_spec.data import IGNORE_INDEX
from lit_spec.decoding.hidden_transfer import HiddenTransferDecoder
from lit_spec.decoding.masks import attention_mask, causal
from lit_spec.methods.draft_heads import TOP_K, check_tree
from lit_spec.methods.frozen_base import FrozenBaseModule
from lit_spec.methods.losses import check_distance, distance
from lit_spec.models.hidden_transfer import HiddenTransfer, transfer_block


class HiddenTransferModule(FrozenBaseModule):
    """Args (besides ``MethodModule``'s): layers (t_1..t_k, one per transfer step, non-decreasing; t = the decoder
    layers that run before the transfer), masked (the ablation's "masked" setting), distance / jsd_beta (D),
    log_cosine (Fig. 4's similarities at validation), tree (the decoder's static tree; depth <= k)."""

    def __init__(self, model_spec, layers=(15, 20), masked: bool = False, distance: str = "forward_kl",
                 jsd_beta: float = 0.5, log_cosine: bool = True, tree=(2, 1, 1), **kwargs):
        check_distance(distance, jsd_beta)
        tree = check_tree(tree, len(layers), f"method.layers has {len(layers)} transfer steps")
        super().__init__(model_spec, tree=tree, layers=list(layers), masked=masked, distance=distance,
                         jsd_beta=jsd_beta, log_cosine=log_cosine, **kwargs)

    def build_trainable(self) -> HiddenTransfer:
        config = self.model.config
        transfer = HiddenTransfer(config.hidden_size, config.vocab_size, self.hparams.layers, self.hparams.masked)
        return transfer.init_from_base(self.model)

    def decoders(self, **sampling) -> dict:
        return {"hidden_transfer": HiddenTransferDecoder(self.model, self.heads, tree=self.hparams.tree, **sampling)}

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        hp, transfer = self.hparams, self.heads
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        (b, t), k = ids.shape, transfer.num_heads
        positions = torch.arange(t, device=ids.device)
        visible, depth = transfer_block(causal(t, ids.device), positions, k, transfer.masked)
        allowed = visible[None] & valid.repeat(1, 1 + k)[:, None, :]        # padding keys (and their chains) unseen
        mask = attention_mask(valid[:, :0], allowed, next(self.model.parameters()).dtype)   # no past: [B, 1, Q, Q]
        cosine = hp.log_cosine and stage == "val"
        with transfer.planned(t, positions):
            out = self.model(input_ids=ids.repeat(1, 1 + k), attention_mask=mask,
                             position_ids=depth[None].expand(b, -1), output_hidden_states=cosine)
        logits, answer = out.logits, batch["labels"] != IGNORE_INDEX
        total = logits.new_zeros(())
        for i in range(1, k + 1):
            student = logits[:, t * i: t * (i + 1) - i]         # pseudo (j, i), j < T - i: stands for position j+i
            teacher = logits[:, i:t]                             # the base's own distribution at j+i
            where = valid[:, i:] & F.pad(answer[:, i + 1:], (0, 1))   # the token after j+i is an answer token
            loss_i = distance(student, teacher, where, hp.distance, hp.jsd_beta)
            total = total + loss_i
            if stage == "val" and where.any():
                self.log(f"val/step{i}/loss", loss_i, batch_size=b, sync_dist=True)
                top = student[where].topk(max(TOP_K), dim=-1).indices == teacher[where].argmax(-1)[:, None]
                for n in TOP_K:
                    self.log(f"val/step{i}/top{n}", top[:, :n].any(-1).float().mean(), batch_size=int(where.sum()),
                             sync_dist=True)
            if cosine:
                self._log_cosine(out.hidden_states, i, t, valid)
        self.log(f"{stage}/loss", total, prog_bar=True, batch_size=b, sync_dist=True)
        return total

    def _log_cosine(self, hidden_states: tuple, i: int, t: int, valid: torch.Tensor) -> None:
        """Fig. 4: cos(pseudo state of (j, i), real state of j+i) after every layer from t_i on (``hidden_states[l]``:
        after l layers, the last one normed; the pseudo state is injected into layer t_i's input)."""
        where, last = valid[:, i:], len(hidden_states) - 1
        for layer in range(min(self.hparams.layers[i - 1] + 1, last), last + 1):
            h = hidden_states[layer]
            cos = F.cosine_similarity(h[:, t * i: t * (i + 1) - i][where].float(), h[:, i:t][where].float(), dim=-1)
            self.log(f"val/step{i}/cos_layer{layer}", cos.mean(), batch_size=int(where.sum()), sync_dist=True)
