"""The README and docs/ stay true to the repository: every relative link resolves (a ``#anchor`` to a heading of the
target markdown file, GitHub's slugs), every ``python -m lit_spec.*`` command written in them composes its config
(what ``--cfg job`` checks: nothing is built or run), and the configuration reference names every option under conf/.
A renamed config, file or heading fails here instead of leaving the docs stale."""

from __future__ import annotations

import re
import shlex
import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from lit_spec.config import config_dir

ROOT = config_dir().parent
PACKAGE = ROOT / "src" / "lit_spec"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
README_MAX_LINES = 250           # the README is a front page; the manual is docs/

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
COMMAND = re.compile(r"python3? -m lit_spec\.(\w+)(.*)")
PLACEHOLDER = re.compile(r"<[^<>\n]*>")     # <run>/export, <date>_<pid>: any path the reader fills in


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


@cache
def split(path: Path) -> tuple[list[tuple[int, str]], str]:
    """A markdown file's fenced code blocks' lines (line number, text) and its prose (code blocks blanked, so prose
    line numbers stay the file's)."""
    code, prose, fenced = [], [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            prose.append("")
        elif fenced:
            code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return code, "\n".join(prose)


def without_inline_code(prose: str) -> str:
    return re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


# ---- links ----------------------------------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation and symbols dropped (hyphens and underscores
    kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").strip().lower()
    kept = [c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"]
    return "".join(kept).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, repeated headings numbered as GitHub numbers them."""
    found, times = set(), {}
    for line in split(path)[1].splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            found.add(f"{base}-{times[base]}" if base in times else base)
            times[base] = times.get(base, 0) + 1
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    prose = without_inline_code(split(path)[1])
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(prose)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1))]          # http:, https:, mailto: are not ours


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_relative_links_resolve(page):
    broken = []
    for line, target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{page.name}:{line}: {target}: no such file")
        elif anchor:
            if resolved.suffix != ".md":
                broken.append(f"{page.name}:{line}: {target}: an anchor into a file that is not markdown")
            elif unquote(anchor) not in anchors(resolved):
                broken.append(f"{page.name}:{line}: {target}: no heading with this anchor in {resolved.name}")
    assert not broken, "\n".join(broken)


def test_slugs_are_githubs():
    assert slug("The offline default: τ ≥ 2 on every setting tried (issue 30), 2-core CPU") == \
        "the-offline-default-τ--2-on-every-setting-tried-issue-30-2-core-cpu"
    assert slug("Training on the target's own answers (`data=self_distilled`)") == \
        "training-on-the-targets-own-answers-dataself_distilled"
    assert slug("Tiny target: the exports on the bench (quiet machine, 20 test prompts × 128 tokens)") == \
        "tiny-target-the-exports-on-the-bench-quiet-machine-20-test-prompts--128-tokens"


# ---- commands -------------------------------------------------------------------------------------------------------
def commands(path: Path) -> list[tuple[int, str, str]]:
    """(line, entry point, the rest of the line) of every ``python -m lit_spec.NAME`` in code blocks (continued
    lines joined) and in inline code spans of the prose."""
    found = []
    code, prose = split(path)
    joined: list[tuple[int, str]] = []
    for number, line in code:
        if joined and joined[-1][1].endswith("\\"):
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
        else:
            joined.append((number, line))
    for number, line in joined:
        found += [(number, m.group(1), m.group(2)) for m in COMMAND.finditer(line)]
    for span in re.finditer(r"`([^`]+)`", prose):
        for m in COMMAND.finditer(span.group(1).replace("\n", " ")):
            found.append((prose.count("\n", 0, span.start()) + 1, m.group(1), m.group(2)))
    return found


def arguments(rest: str) -> list[str]:
    """The command's own arguments: placeholders filled, up to a comment or the shell's next operator."""
    lexer = shlex.shlex(PLACEHOLDER.sub("X", rest), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    args = []
    for token in lexer:
        if token and set(token) <= set("();<>|&"):
            break
        args.append(token)
    return args


@cache
def entry_config(module: str) -> str | None:
    """The config a ``python -m lit_spec.<module>`` composes (its ``@hydra.main``'s config_name), None if it has
    none."""
    source = PACKAGE / f"{module}.py"
    match = re.search(r"@hydra\.main\(.*?config_name=\"(\w+)\"", source.read_text(), re.S) if source.is_file() else None
    return match.group(1) if match else None


def compositions(module: str, args: list[str]) -> tuple[str, list[list[str]]]:
    """The config name and the override lists that the command composes: a multirun sweep gives one list per swept
    value (the other sweeps at their first)."""
    config_name, multirun, overrides = entry_config(module), False, []
    if config_name is None:
        raise ValueError(f"lit_spec.{module} is not a Hydra entry point")
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in ("--cfg", "-c"):
            i += 1
            if i == len(args) or args[i] not in ("job", "hydra", "all"):
                raise ValueError("--cfg takes job, hydra or all")
        elif arg in ("--config-name", "-cn"):
            i += 1
            config_name = args[i]
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif arg == "--resolve":
            pass
        elif arg.startswith("-"):
            raise ValueError(f"unknown flag {arg}")
        else:
            overrides.append(arg)
        i += 1
    parsed = OverridesParser.create().parse_overrides(overrides)
    sweeps = [n for n, o in enumerate(parsed) if o.is_sweep_override()]
    if sweeps and not multirun:
        raise ValueError(f"{parsed[sweeps[0]].input_line} sweeps: the command needs -m")
    first = [f"{parsed[n].get_key_element()}={next(iter(parsed[n].sweep_string_iterator()))}" if n in sweeps
             else overrides[n] for n in range(len(overrides))]
    runs = [first]
    for n in sweeps:
        for value in list(parsed[n].sweep_string_iterator())[1:]:
            runs.append([*first[:n], f"{parsed[n].get_key_element()}={value}", *first[n + 1:]])
    return config_name, runs


def test_command_parsing():
    assert arguments("+experiment=a 'decoding=[x,y]' b=<run>/export  # a comment") == \
        ["+experiment=a", "decoding=[x,y]", "b=X/export"]
    assert arguments("c=1 && .venv/bin/python -m pytest") == ["c=1"]
    assert compositions("train", ["-m", "method=a,b", "x.lr=1,2"]) == \
        ("train", [["method=a", "x.lr=1"], ["method=b", "x.lr=1"], ["method=a", "x.lr=2"]])
    assert compositions("stages", ["--config-name", "bench", "+list=true"]) == ("bench", [["+list=true"]])
    with pytest.raises(ValueError, match="needs -m"):
        compositions("train", ["method.lr=1,2"])
    with pytest.raises(ValueError, match="not a Hydra entry point"):
        compositions("no_such_module", [])


# the README's commands in the unit tier; the manual's (some 120 composes, a sixth of the unit tier) in the slow one
COMPOSED = [pytest.param(p, id=i, marks=[] if p.name == "README.md" else [pytest.mark.slow])
            for p, i in zip(PAGES, _ids(PAGES))]


@pytest.mark.parametrize("page", COMPOSED)
def test_commands_compose(page):
    """Each command composes its entry point's config as ``--cfg job`` does, in this process (nothing is built)."""
    failures, done = [], {}
    found = commands(page)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        for line, module, rest in found:
            where = f"{page.name}:{line}: python -m lit_spec.{module}{rest}"
            try:
                config_name, runs = compositions(module, arguments(rest))
                for overrides in runs:
                    key = (config_name, tuple(overrides))
                    if key not in done:
                        compose(config_name=config_name, overrides=overrides)
                        done[key] = True
            except Exception as e:  # noqa: BLE001 - every failure is listed with its line
                failures.append(f"{where}\n    {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    assert not failures, "\n".join(failures)
    if page.name == "README.md":
        assert len(found) >= 5, "the README's commands were not found"


# ---- the pages themselves -------------------------------------------------------------------------------------------
def test_readme_is_a_front_page_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README is a front page: move the details to docs/"
    linked = {(ROOT / unquote(t.partition("#")[0])).resolve() for _, t in relative_links(ROOT / "README.md")}
    assert DOCS and not [p.name for p in DOCS if p.resolve() not in linked], "a docs page the README does not link"


def test_configuration_reference_lists_every_option_of_every_group():
    """docs/configuration.md's table of config groups names every option under conf/ (a new config that the docs
    do not mention fails here)."""
    conf = config_dir()
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip().strip("`").split("`")[0]: line for line in text.splitlines()
            if line.startswith("| `")}
    groups = [p.name for p in conf.iterdir() if p.is_dir() and p.name not in {"hydra", "paths"}]
    missing = [f"{group}={p.stem}" for group in sorted(groups) for p in sorted((conf / group).glob("*.yaml"))
               if not p.name.startswith("_") and f"`{p.stem}`" not in rows.get(group, "")]
    assert not missing, f"docs/configuration.md's config table lacks: {missing}"
