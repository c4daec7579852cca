from lit_spec.data.datamodule import IGNORE_INDEX, PromptDataModule, batch_size, num_tokens
from lit_spec.data.sources import HFSource, StdlibCodeSource, sharegpt_first_turn
from lit_spec.data.templates import PromptTemplate

__all__ = ["IGNORE_INDEX", "PromptDataModule", "PromptTemplate", "HFSource", "StdlibCodeSource",
           "batch_size", "num_tokens", "sharegpt_first_turn"]
