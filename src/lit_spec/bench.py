"""``python -m lit_spec.bench [overrides]``: benchmark decoding methods side by side (see conf/bench.yaml).

    python -m lit_spec.bench                                        # tiny target + tiny draft, stdlib-code prompts
    python -m lit_spec.bench decoding=[jacobi] decoding.jacobi.n_tokens=32
    python -m lit_spec.bench model=hf model.name_or_path=DIR draft=null 'bench.hf_peers=[generate]'
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from lit_spec.config import config_dir
from lit_spec.errors import one_line_errors


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> None:
    from lit_spec.benchmark import markdown_table, run_benchmark
    from lit_spec.console import bench_summary, tidy_logging

    tidy_logging()
    with one_line_errors():
        results = run_benchmark(cfg, Path(cfg.paths.output_dir))
    print(markdown_table(results))
    print(bench_summary(results, Path(cfg.paths.output_dir)))


if __name__ == "__main__":
    main()
