from lit_spec.methods.ar import ARModule
from lit_spec.methods.cllm import CLLMModule

__all__ = ["ARModule", "CLLMModule"]
