"""Lightning's model summary without its FLOPs: Lightning counts them only for a module with an
``example_input_array``, which no method here has (their batches are dicts of several tensors), so every run printed
a FLOPs column of zeros and "Total FLOPs: 0". Plain text, so the table goes to the run's log too."""

from __future__ import annotations

import logging

from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.callbacks.model_summary import _format_summary_table

log = logging.getLogger(__name__)


class ModelSummary(LightningModelSummary):
    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **kwargs) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, 0,
                                      *columns)
        log.info("\n" + table.rsplit("\n", 1)[0])       # the last line is the FLOPs total
