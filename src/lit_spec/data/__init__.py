from lit_spec.data.base_states import BaseStates
from lit_spec.data.datamodule import (IGNORE_INDEX, AnswerBatches, PromptDataModule, batch_size, collate_answers,
                                     num_tokens)
from lit_spec.data.metrics import METRICS, get_metric
from lit_spec.data.sources import (HFSource, MixedSource, StdlibCodeSource, chat_first_turn, chat_turns,
                                   mbpp_tests, sharegpt_first_turn, sharegpt_turns)
from lit_spec.data.templates import PromptTemplate
from lit_spec.data.self_distilled import SelfDistilledDataModule
from lit_spec.data.noisy_trajectories import NoisyTrajectoryDataModule
from lit_spec.data.trajectory_data import TrajectoryDataModule

__all__ = ["IGNORE_INDEX", "METRICS", "AnswerBatches", "BaseStates", "PromptDataModule", "SelfDistilledDataModule",
           "PromptTemplate", "HFSource", "NoisyTrajectoryDataModule", "StdlibCodeSource", "TrajectoryDataModule", "batch_size", "collate_answers",
           "get_metric", "mbpp_tests", "num_tokens", "sharegpt_first_turn", "sharegpt_turns", "MixedSource",
           "chat_first_turn", "chat_turns"]
