"""Jacobi trajectory collection (CLLM §3.2.1, Algorithm 1): ``run_collection`` behind ``python -m lit_spec.collect``.

``plan``: settings checks, batch planning, seeds. ``collector``: the LightningModule that decodes and writes parts.
``progress``: the tok/s progress callback. ``run``: the run itself (resume, finish, meta.json). ``reference``: the
paper's algorithm without KV cache (a correctness and throughput baseline).
"""

from lit_spec.collection.collector import TrajectoryCollector, make_record
from lit_spec.collection.plan import check_settings, derive_seed, plan_batches
from lit_spec.collection.reference import reference_trajectories
from lit_spec.collection.run import run_collection

__all__ = ["TrajectoryCollector", "check_settings", "derive_seed", "make_record", "plan_batches",
           "reference_trajectories", "run_collection"]
