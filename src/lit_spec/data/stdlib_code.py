"""stdlib-code: docstring -> function pairs from the Python standard library installed on this machine.

A CodeSearchNet-Python stand-in that needs no network. Every function (or method) with a docstring becomes one
pair: the prompt is its cleaned docstring, the answer is its source with the docstring removed. The split is
decided per pair by a seeded hash of its stable id (``module:qualname``), so it does not move when other files
change.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterator

# Directories of the stdlib that are tests, demos, vendored third-party code or generated tables.
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "ensurepip", "turtledemo",
              "__phello__", "encodings", "pydoc_data", "venv"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Yield (qualname, node) for every function and method, nested classes included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.stmt):  # functions defined under if/try/with blocks
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _split_of(key: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    u = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"


def source_lines(source: str) -> list[str]:
    """``source`` split into lines as ``ast`` numbers them (``str.splitlines`` also splits on \\f, \\x1c, ...)."""
    return re.split(r"\r\n|\r|\n", source)


def function_pair(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    """(docstring, code without its docstring) of one function node, or None if it has no docstring.

    ``lines`` are the module's ``source_lines``.
    """
    doc = ast.get_docstring(node, clean=True)
    if not doc:
        return None
    if len(node.body) == 1:  # body was only the docstring
        return None
    doc_node = node.body[0]
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    kept = lines[start:doc_node.lineno - 1] + lines[doc_node.end_lineno:node.end_lineno]
    # Remove the def's own indentation. Not textwrap.dedent: a multi-line string or a comment at column 0 in the
    # body would leave a method indented, and its code would not parse.
    indent = lines[node.lineno - 1][:node.col_offset]
    code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in kept).strip("\n")
    return doc, code


def source_files(root: Path) -> list[Path]:
    """The corpus's files under ``root``, sorted (tests, demos and vendored code left out). Skipped directories are
    never entered: the stdlib's own tests are most of its files, and a run lists them at every load."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIP_PARTS]
        found += [Path(folder, name) for name in files if name.endswith(".py")]
    return sorted(found)


def fingerprint(root: Path | None = None) -> str:
    """A hash of every corpus file's path, size and modification time: what was parsed, for a cache of the pairs."""
    root = Path(root) if root is not None else stdlib_dir()
    digest = hashlib.sha256(str(root).encode())
    for path in source_files(root):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def iter_pairs(root: Path | None = None, seed: int = 0, val_fraction: float = 0.05, test_fraction: float = 0.05,
               min_doc_chars: int = 10, max_doc_chars: int = 1000, max_code_lines: int = 60,
               min_code_lines: int = 3) -> Iterator[dict]:
    """Yield {id, docstring, code, split} for each kept function, in a fixed (sorted) order."""
    root = Path(root) if root is not None else stdlib_dir()
    for path in source_files(root):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source_lines(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        seen: dict[str, int] = {}
        for qualname, node in _functions(tree):
            pair = function_pair(lines, node)
            if pair is None:
                continue
            doc, code = pair
            n_lines = code.count("\n") + 1
            if not (min_doc_chars <= len(doc) <= max_doc_chars and min_code_lines <= n_lines <= max_code_lines):
                continue
            key = f"{module}:{qualname}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:  # redefinitions (property setters, platform branches) get a stable suffix
                key = f"{key}#{seen[key]}"
            yield {"id": key, "docstring": doc, "code": code,
                   "split": _split_of(key, seed, val_fraction, test_fraction)}
