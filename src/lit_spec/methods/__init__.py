from lit_spec.methods.ar import ARModule
from lit_spec.methods.cllm import CLLMModule
from lit_spec.methods.heads import ChimeraModule, MedusaModule

__all__ = ["ARModule", "CLLMModule", "ChimeraModule", "MedusaModule"]
