"""lit_spec: train and measure LLM decoding acceleration with Lightning + Hydra."""

__version__ = "0.1.0"
