from lit_spec.methods.ar import ARModule
from lit_spec.methods.cllm import CLLMModule, PackedCLLMModule
from lit_spec.methods.dflash import DFlashModule
from lit_spec.methods.draft_distill import DraftDistillModule
from lit_spec.methods.draft_heads import ChimeraModule, MedusaModule
from lit_spec.methods.eagle3 import Eagle3Module
from lit_spec.methods.hidden_transfer import HiddenTransferModule
from lit_spec.methods.jacobi_forcing import JacobiForcingModule

__all__ = ["ARModule", "CLLMModule", "DraftDistillModule", "ChimeraModule", "MedusaModule", "HiddenTransferModule",
           "JacobiForcingModule", "PackedCLLMModule", "Eagle3Module", "DFlashModule"]
