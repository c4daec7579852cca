from lit_spec.callbacks.speedup import SpeedupCallback

__all__ = ["SpeedupCallback"]
