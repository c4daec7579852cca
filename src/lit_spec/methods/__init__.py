from lit_spec.methods.ar import ARModule

__all__ = ["ARModule"]
