"""A model produced by an earlier stage: the export of ``+experiment=<stage>`` (e.g. the tiny target).

``lit_spec.stages`` composes that experiment, keys the cache entry by its config, trains it once when missing and
sets ``name_or_path`` to the export; this spec only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_spec.models.spec import HFModelSpec


@dataclass
class StageModelSpec(HFModelSpec):
    """Args:
        stage: the experiment (``conf/experiment/<stage>.yaml``) that trains and exports the model.
        seed: the initial-weights seed of the model that experiment pretrains (its ``model.seed``); null: the
            experiment's own. Another seed builds another model (another cache entry), e.g. to check that a result
            does not hang on one draw of the tiny target.
    """

    name_or_path: str = ""
    stage: str = "tiny_target"
    seed: int | None = None
