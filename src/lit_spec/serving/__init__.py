"""Serving what lit_spec trains in vLLM: exports in its layouts (``vllm_export``), and vLLM run from its own environment (``vllm_runner``)."""
