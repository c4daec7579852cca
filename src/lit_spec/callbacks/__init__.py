from lit_spec.callbacks.interrupt import InterruptCheckpoint
from lit_spec.callbacks.memory import MemoryMonitor
from lit_spec.callbacks.model_summary import ModelSummary
from lit_spec.callbacks.speedup import SpeedupCallback

__all__ = ["InterruptCheckpoint", "MemoryMonitor", "ModelSummary", "SpeedupCallback"]
