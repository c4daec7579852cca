"""Where the Hydra configs live, composing them outside an app, building objects from them, and hashing a config
for stage caches."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lit_spec.errors import ConfigError, LitSpecError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
# ${pid:} in a run directory's name (conf/hydra/default.yaml): runs started in the same second get their own directory
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)


def config_dir() -> Path:
    if not (CONFIG_DIR / "train.yaml").is_file():
        raise LitSpecError(f"lit_spec's Hydra configs were not found at {CONFIG_DIR}: install the project from its "
                           "repository with `pip install -e .` so that conf/ stays next to the package")
    return CONFIG_DIR


def compose_config(overrides: Sequence[str] = (), config_name: str = "train") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with overrides, inside a running Hydra app or outside one. Outside one, a
    composition is kept per (overrides, conf/ as it is on disk) and each call gets its own copy: a process composes
    the same stage and data configs again and again, and each compose parses some 25 YAML files."""
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides))
    return copy.deepcopy(_composed(tuple(overrides), config_name, _conf_stamp()))


@functools.lru_cache(maxsize=256)
def _composed(overrides: tuple[str, ...], config_name: str, stamp: tuple) -> DictConfig:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def _conf_stamp() -> tuple:
    """conf/'s YAML files, each with its size and last change: an edited, added or removed config composes anew."""
    return tuple(sorted((str(p), s.st_size, s.st_mtime_ns) for p in config_dir().rglob("*.yaml") for s in [p.stat()]))


def config_hash(obj, length: int = 10) -> str:
    """A short, stable hash of a (Dict)Config or plain container; interpolations are hashed unresolved. Keys whose
    value is null are left out, so adding an option with a null default keeps the hashes of existing configs (and
    the stage caches keyed by them)."""
    if isinstance(obj, DictConfig):
        obj = OmegaConf.to_container(obj, resolve=False)
    blob = json.dumps(without_nulls(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def cache_entry(cache_dir, name: str) -> Path:
    """``cache_dir/name`` (``~`` expanded); an empty ``cache_dir`` (e.g. ``LIT_SPEC_CACHE=""``) is an error rather
    than a cache scattered over the working directory."""
    if not str(cache_dir or "").strip():
        raise ConfigError("paths.cache_dir is empty (is LIT_SPEC_CACHE set to an empty string?): unset it for "
                          "~/.cache/lit_spec or give it a directory")
    return Path(cache_dir).expanduser() / name


def without_nulls(obj):
    """``obj`` with every null-valued key of its dicts left out, recursively."""
    if isinstance(obj, dict):
        return {k: without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [without_nulls(v) for v in obj]
    return obj


def build(node: DictConfig, **kwargs):
    """``instantiate(node)(**kwargs)``, with primitives for containers; a ``LitSpecError`` raised while building comes
    out as itself (Hydra wraps it in an ``InstantiationException``), so the entry point prints its one line."""
    try:
        factory = instantiate(node, _partial_=True, _convert_="all")
    except InstantiationException as e:
        if isinstance(e.__cause__, LitSpecError):
            raise e.__cause__ from None
        raise
    return factory(**kwargs)
