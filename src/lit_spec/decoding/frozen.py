"""``engine=frozen``'s forwards: each block width exported (``torch.export``) and compiled ahead of time by
AOTInductor with the weights as constants, into a package kept on disk under ``$LIT_SPEC_CACHE/frozen`` (default
``~/.cache/lit_spec/frozen``). A package's name is a hash of the weights and of everything its code depends on, so a
later process with the same model loads a width in seconds instead of compiling it for 85-125 s (SmolLM2 on a
2-core EPYC), and a changed model, host or library compiles anew. The package runs the forward with the static
cache's tensors as inputs, which it updates in place as the eager forward does.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
from pathlib import Path

import torch
import transformers

from lit_spec.decoding import cache as kv
from lit_spec.io import atomic_file

log = logging.getLogger(__name__)

# the weights as constants, so inductor packs them for its C++ GEMM template, which autotuning picks over MKL's where
# it is faster (SmolLM2's one-row GEMMs on a 2-core EPYC: experiments/RESULTS.md); kept in the package beside the
# library, not inside it, a loaded width holds them once: 624 MB resident for SmolLM2's 544, against 1162 MB
CPU_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
               "aot_inductor.package_constants_in_so": False,
               "aot_inductor.package_constants_on_disk_format": "binary_blob"}
GPU_OPTIONS = {"freezing": True}


def package_dir() -> Path:
    return Path(os.environ.get("LIT_SPEC_CACHE") or "~/.cache/lit_spec").expanduser() / "frozen"


def fingerprint(model, options: dict) -> str:
    """A hash of the model's weights and buffers, its class and config, and what the compiled code depends on: our
    code that it traces, the libraries' versions, the device and CPU capability, the threads inductor tuned its
    kernels for, the options."""
    device = next(model.parameters()).device
    digest = hashlib.blake2b(digest_size=12)
    # the code traced beside the model's: this module and the fast path's (its attention)
    for module in (sys.modules[__name__], sys.modules["lit_spec.decoding.fast"]):
        digest.update(inspect.getsource(module).encode())
    for part in (type(model).__qualname__, model.config.to_json_string(), torch.__version__,
                 transformers.__version__, str(device), torch.backends.cpu.get_cpu_capability(),
                 torch.cuda.get_device_name(device) if device.type == "cuda" else "", torch.get_num_threads(),
                 sorted(options.items())):
        digest.update(repr(part).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
    return digest.hexdigest()


class Step(torch.nn.Module):
    """One forward of ``body`` (the decoder stack or the whole model) on a static cache whose tensors come in as
    inputs: what a package compiles."""

    def __init__(self, body, cache: kv.StaticCache, cache_keyword: str, hidden: bool):
        super().__init__()
        self.body, self.cache, self.cache_keyword, self.hidden = body, cache, cache_keyword, hidden

    def forward(self, ids, mask, position_ids, *tensors):
        out = self.body(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        output_hidden_states=self.hidden,
                        **{self.cache_keyword: kv.static_cache_on(self.cache, tensors)})
        main = out.logits if hasattr(out, "logits") else out.last_hidden_state
        return (main, out.hidden_states) if self.hidden else (main,)


class FrozenForwards:
    """An engine's packages, one per (width, hidden states or not, cache length), loaded from disk or compiled there.
    The weights live in the packages, not the model: it is not kept alive from here."""

    def __init__(self, options: dict):
        self.options = options
        self.runners: dict[tuple, object] = {}
        self.loaded: set[tuple] = set()        # the keys found on disk, not compiled in this process
        self._fingerprint: str | None = None

    def path(self, model, key: tuple) -> Path:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(model, self.options)
        width, hidden, cache_length, batch, attended = key
        rows = f"x{batch}a{attended}" if batch > 1 else ""
        return package_dir() / f"{self._fingerprint}-{width}{'h' if hidden else ''}-{cache_length}{rows}.pt2"

    def __call__(self, engine, key: tuple, ids, mask, position_ids) -> tuple:
        """Run ``key``'s package (width, hidden states or not, cache length, batch, positions attended) on these
        inputs and ``engine``'s static cache: the stack's last hidden states (the model's logits where it runs
        whole), then the hidden states where asked."""
        tensors = kv.static_tensors(engine.cache)
        if key not in self.runners:
            path = self.path(engine.model, key)
            runner = self._load(path)
            if runner is None:
                step = Step(engine.body, engine.cache, engine.cache_keyword, hidden=key[1])
                self._compile(path, step, (ids, mask, position_ids, *tensors))
                runner = torch._inductor.aoti_load_package(str(path))
            else:
                self.loaded.add(key)
            self.runners[key] = runner
        return self.runners[key](ids, mask, position_ids, *tensors)

    @staticmethod
    def _load(path: Path):
        """The package at ``path``, or None where there is none, or one that does not load (compiled anew)."""
        if not path.exists():
            return None
        try:
            return torch._inductor.aoti_load_package(str(path))
        except RuntimeError as error:
            log.warning("engine=frozen: %s does not load (%s): compiling it anew", path, error)
            return None

    def _compile(self, path: Path, step: Step, inputs: tuple) -> None:
        log.info("engine=frozen: compiling a forward of width %d into %s, once for this model and host (minutes on a "
                 "CPU; later runs load it)", inputs[0].size(1), path)
        program = torch.export.export(step, inputs, strict=False)
        with atomic_file(path) as tmp, open(tmp, "wb") as file:
            # a copy: AOTInductor writes its own settings into the dict it is given
            torch._inductor.aoti_compile_and_package(program, package_path=file, inductor_configs=dict(self.options))
