"""``python -m lit_spec.train [overrides]``: compose conf/train.yaml with Hydra and train.

    python -m lit_spec.train                                   # the offline default (tiny model, stdlib-code)
    python -m lit_spec.train +experiment=cllm_spider           # a paper experiment
    python -m lit_spec.train -m method.lr=1e-5,2e-5            # a sweep, one run directory per job
"""

from __future__ import annotations


import hydra
from omegaconf import DictConfig

from lit_spec.config import config_dir
from lit_spec.errors import one_line_errors


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float | None:
    from lit_spec.console import tidy_logging
    from lit_spec.training import run_training  # imported here: `--cfg job` / `--help` need no torch/lightning

    tidy_logging()
    with one_line_errors():
        metrics = run_training(cfg)
    return metrics.get(cfg.get("optimized_metric") or "", None)


if __name__ == "__main__":
    main()
