"""A model produced by an earlier stage (e.g. the tiny target, pretrained by ``+experiment=tiny_target``).

The stage's composed config is hashed; its exported model is cached under ``cache_dir/<stage>-<hash>`` and reused by
every later run. A missing cache entry is built on first use by running that experiment's training, in a fixed run
directory (``cache_dir/runs/<stage>-<hash>``): an interrupted build resumes from its last checkpoint there, because
``OnExceptionCheckpoint`` makes Lightning's ``fit`` pick up the newest checkpoint of its directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from lit_spec.config import cache_entry, compose_config, config_hash
from lit_spec.models.spec import HFModelSpec

log = logging.getLogger(__name__)

HASHED_GROUPS = ("model", "data", "method", "trainer", "seed")


@dataclass
class StageModelSpec(HFModelSpec):
    """Args: stage: name of the experiment (``conf/experiment/<stage>.yaml``) that trains and exports the model."""

    name_or_path: str = ""
    stage: str = "tiny_target"
    cache_dir: str = ".cache/lit_spec"

    def __post_init__(self):
        super().__post_init__()
        self._cfg = compose_config([f"+experiment={self.stage}", f"paths.cache_dir={self.cache_dir}"])
        key = config_hash(OmegaConf.masked_copy(self._cfg, list(HASHED_GROUPS)))
        self.name_or_path = str(cache_entry(self.cache_dir, f"{self.stage}-{key}"))

    def prepare(self) -> None:
        out = Path(self.name_or_path)
        if (out / "config.json").is_file():
            return
        from omegaconf import open_dict

        from lit_spec.training import run_training

        log.info("stage '%s' is not cached: training it now (once) into %s", self.stage, out)
        cfg = self._cfg.copy()
        with open_dict(cfg):
            cfg.paths.output_dir = str(out.parent / "runs" / out.name)
            cfg.export_dir = str(out)
        run_training(cfg)
