"""``python -m lit_spec.collect [overrides]``: collect Jacobi trajectories for CLLM training (see conf/collect.yaml).

    python -m lit_spec.collect                                          # tiny target, stdlib-code train + validation
    python -m lit_spec.collect collect.n_tokens=32 collect.max_prompts=1000 collect.out_dir=data/traj
    python -m lit_spec.collect trainer.devices=2 strategy=ddp_spawn      # 2 processes; rerun the same command to resume
"""

from __future__ import annotations


import hydra
from omegaconf import DictConfig

from lit_spec.config import config_dir
from lit_spec.errors import one_line_errors


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="collect")
def main(cfg: DictConfig) -> None:
    from lit_spec.collection import run_collection  # imported here: `--cfg job` / `--help` need no torch/lightning
    from lit_spec.console import collection_summary, tidy_logging
    from lit_spec.data.trajectories import read_meta

    tidy_logging()
    with one_line_errors():
        out = run_collection(cfg)
    print(collection_summary(out, read_meta(out)))


if __name__ == "__main__":
    main()
