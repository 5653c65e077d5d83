"""The docs a maintainer navigates by: numbered sections run in order, once each; every
relative link leads to a file (and, with an anchor, to a heading of it); every `make`
target and `adaptive-rollout` subcommand the docs name exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from functools import cache
from pathlib import Path

import pytest

from sampler_service.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

#: Words that follow the program's name in what it prints, not subcommands: the server's
#: start-up line reads "adaptive-rollout sampler listening on ...".
NOT_SUBCOMMANDS = {"sampler"}

_FENCED = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", re.M | re.S)
_INDENTED = re.compile(r"(?:(?<=\n\n)|\A)((?:(?: {4}|\t)[^\n]*(?:\n|\Z))+)")
_CODE_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
#: Where a command starts: a line's or a span's start, or after `&&`, `;`, `|` or `(`, past
#: any `NAME=value` assignments.
_AT_COMMAND = r"(?:^|&&|[;|(])[ \t]*(?:\w+=\S*[ \t]+)*"
_MAKE = re.compile(_AT_COMMAND + r"make(?:[ \t]+-[-\w]+)*[ \t]+([A-Za-z][\w.-]*)(?![\w.=<-])", re.M)
_COMMAND = re.compile(_AT_COMMAND + r"(?:\S*/)?adaptive-rollout[ \t]+([a-z][\w-]*)(?![\w<-])", re.M)


def pages() -> list[Path]:
    """Every page the checks cover."""
    return [
        REPO / "README.md",
        REPO / "BENCHMARKS.md",
        *sorted(DOCS.glob("*.md")),
        *sorted((REPO / "bench" / "notes").glob("*.md")),
        *sorted((REPO / "deploy").rglob("README.md")),
    ]


def split_code(text: str, spans: bool = True) -> tuple[str, list[str]]:
    """The text with its code blanked out (fenced and indented blocks, and inline spans
    unless `spans` is false), and the code."""
    code: list[str] = []

    def keep(match: re.Match[str]) -> str:
        snippet = match.group(match.re.groups)  # the last group is the code
        code.append(textwrap.dedent(snippet) if match.re is _INDENTED else snippet)
        return "\n" * match.group(0).count("\n")

    text = _INDENTED.sub(keep, _FENCED.sub(keep, text))
    return (_CODE_SPAN.sub(keep, text) if spans else text), code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup reduced to its text, lowercase,
    punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of a page, repeated headings numbered as GitHub does."""
    prose, _ = split_code(page.read_text(encoding="utf-8"), spans=False)
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(prose):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` that lead nowhere, each as `target: why`."""
    prose, _ = split_code(page.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


def named(page: Path, pattern: re.Pattern[str]) -> set[str]:
    """What `pattern` captures in the page's code: its blocks and inline spans."""
    _, code = split_code(page.read_text(encoding="utf-8"))
    return {m for snippet in code for m in pattern.findall(snippet)}


@cache
def make_targets() -> frozenset[str]:
    """Every target the Makefile and make/*.mk define, from make's own database."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    database = subprocess.run(
        [make, "-pRrqn", "--no-print-directory", "-f", "Makefile"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    ).stdout  # fmt: skip
    targets = set()
    not_a_target = False
    for line in database.splitlines():
        m = re.match(r"([^\s#:=%][^\s:=%]*):(?!=)", line)
        if m and not not_a_target:
            targets.add(m.group(1))
        not_a_target = line == "# Not a target:"
    return frozenset(targets)


def test_numbered_sections_run_in_order() -> None:
    for page in DOCS.glob("*.md"):
        numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", page.read_text(), re.M)]
        assert numbers == list(range(1, len(numbers) + 1)), (page.name, numbers)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_make_targets_named_exist(page: Path) -> None:
    assert not named(page, _MAKE) - make_targets()


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_subcommands_named_exist(page: Path) -> None:
    assert not named(page, _COMMAND) - set(COMMANDS) - NOT_SUBCOMMANDS


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## 2. A `code` heading, punctuated!\n")
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#2-a-code-heading-punctuated) [ok](#page) "
        "[web](https://example.com/missing)\n"
        "[gone](missing.md) [no heading](other.md#nope) ![gone](img.png)\n"
        "`[not a link](inside/code.md)`\n\n"
        "```bash\nmake demo && make no-such-target\nadaptive-rollout serve --model m\n"
        "adaptive-rollout no-such-command\n```\n\n"
        "```\nmake/    per-suite make targets; the `adaptive-rollout` dispatcher\n```\n\n"
        "Run `make test-unit` or `.venv/bin/adaptive-rollout stats`, or `make bench-<name>`, or\n\n"
        "    make lint    # [not a link](nowhere.md)\n\nthen [gone](gone.md).\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nope: no heading with that anchor in other.md",
        "img.png: no such file",
        "gone.md: no such file",
    ]
    assert named(page, _MAKE) - make_targets() == {"no-such-target"}
    assert named(page, _MAKE) & make_targets() == {"demo", "test-unit", "lint"}
    assert named(page, _COMMAND) - set(COMMANDS) == {"no-such-command"}
    assert named(page, _COMMAND) & set(COMMANDS) == {"serve", "stats"}
    assert slug("1. `bench/adaptive_sim.py`: what each rule costs") == (
        "1-benchadaptive_simpy-what-each-rule-costs"
    )
