"""Every relative link in the repository's Markdown, and every Markdown path a config comment names, points at
something that exists: the file (relative to the linking file; a config comment's path relative to the repository
root), and, for `path#anchor` or an in-page `#anchor`, a heading of that Markdown file under GitHub's slug rules.
A prose path with a folder (docs/devices.md) must name a file from there or the root, and a cited section by its
quoted title (`benchmarks/RESULTS.md, "Learning on the real model"`) must start a heading of that file. Links to
other sites (http, https, mailto) are not fetched.

Docs are read in the tree as git tracks it (`git ls-files '*.md'`), tests/ aside (its Markdown is fixture data).
Each failure names the linking file, its line and the missing target, so a moved file or a renamed heading is
found where it is cited, not by a reader following the link.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.paths import REPO

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target up to whitespace (a title may follow) or the closing parenthesis.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# A path to a Markdown file in prose or a comment: docs/devices.md, benchmarks/RESULTS.md#anchor.
MD_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)(#[\w-]+)?")
# A section cited by its title right after the file: `docs/rewards.md, "Code reward"`, `RESULTS.md's "Where ..."`.
QUOTED_SECTION = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)\)?(?:,|'s)\s+\"([^\"]{2,80})\"")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def shown(path: Path) -> str:
    """A path as a failure message names it: from the repository root when inside it."""
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


@functools.cache
def markdown_files() -> tuple[Path, ...]:
    """The tracked Markdown files, tests/ aside (listed once: every bare-name mention looks them up)."""
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return tuple(REPO / name for name in out.stdout.split() if not name.startswith("tests/"))


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a Markdown file's lines outside fenced code blocks, inline code spans blanked."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text lowercased, every character that is not a letter,
    digit, space, hyphen or underscore dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_ markers, not snake_case
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@functools.cache
def heading_texts(path: Path) -> tuple[str, ...]:
    """A Markdown file's ATX headings' texts, in order, outside fenced code (read once per file: every link into
    it asks)."""
    texts, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := ATX_HEADING.match(line)):
            texts.append(m.group(2))
    return tuple(texts)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: a repeated slug gets -1, -2, ... after its first use."""
    seen: Counter[str] = Counter()
    out = set()
    for text in heading_texts(path):
        base = slug(text)
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def check_target(source: Path, line: int, target: str, base: Path) -> str | None:
    """None when `target` (a path, path#anchor or #anchor, relative to `base`) exists, else the failure message."""
    where = f"{shown(source)}:{line}"
    path_part, _, anchor = target.partition("#")
    path_part = path_part.split("?")[0]
    resolved = source if not path_part else (base / path_part).resolve()
    if not resolved.exists():
        return f"{where}: links to {target!r}, but {path_part!r} does not exist (resolved to {resolved})"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{where}: links to {target!r}, but {shown(resolved)} has no heading with anchor #{anchor}"
    return None


def mentioned_file(source: Path, name: str, base: Path) -> Path | None:
    """The Markdown file a prose mention names: `name` from `base` or the repository root, or, for a bare file
    name (`RESULTS.md`), the one tracked Markdown file of that name; None when none (or several) match."""
    for candidate in (base / name, REPO / name):
        if candidate.exists():
            return candidate.resolve()
    if "/" not in name:
        matches = [path for path in markdown_files() if path.name == name]
        if len(matches) == 1:
            return matches[0]
    return None


def check_section(source: Path, line: int, target: str, title: str, base: Path) -> str | None:
    """None when the Markdown file `target` names has a heading starting with `title`, else the failure message."""
    resolved = mentioned_file(source, target, base)
    if resolved is None:
        return None  # not a repository file (a run's report.md): its paths are checked where they are links
    if any(text.lower().startswith(title.lower()) for text in heading_texts(resolved)):
        return None
    return f"{shown(source)}:{line}: cites section {title!r} of {target}, which has no such heading"


def check_mention(source: Path, line: int, target: str, base: Path) -> str | None:
    """None when a prose path with a folder (`docs/devices.md#anchor`) names a file from `base` or the repository
    root, and its anchor a heading there; else the failure message."""
    name, _, anchor = target.partition("#")
    resolved = mentioned_file(source, name, base)
    if resolved is None:
        return f"{shown(source)}:{line}: names {target!r}, which exists neither from {base} nor the root"
    if anchor and anchor not in anchors(resolved):
        return f"{shown(source)}:{line}: names {target!r}, but {name} has no heading with anchor #{anchor}"
    return None


def markdown_problems(path: Path) -> list[str]:
    """Every broken relative link, anchor, prose path (one with a folder) and quoted section in one Markdown file."""
    problems = []
    for number, line in prose_lines(path):
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        if m := REFERENCE_DEF.match(line):
            targets.append(m.group(1))
        for target in targets:
            if target.startswith(EXTERNAL):
                continue
            if problem := check_target(path, number, target, path.parent):
                problems.append(problem)
        for m in MD_PATH.finditer(INLINE_LINK.sub(" ", line)):
            if "/" in m.group(1) and (problem := check_mention(path, number, m.group(0), path.parent)):
                problems.append(problem)
        for m in QUOTED_SECTION.finditer(line):
            if problem := check_section(path, number, m.group(1), m.group(2), path.parent):
                problems.append(problem)
    return problems


def config_problems(path: Path) -> list[str]:
    """Every Markdown path (and #anchor, quoted section) in a config's comments that does not resolve from the
    repository root, where the configs' comments name docs from."""
    problems = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        _, hash_mark, comment = line.partition("#")
        if not hash_mark:
            continue
        for m in MD_PATH.finditer(comment):
            target = m.group(1) + (m.group(2) or "")
            if problem := check_target(path, number, target, REPO):
                problems.append(problem)
        for m in QUOTED_SECTION.finditer(comment):
            if problem := check_section(path, number, m.group(1), m.group(2), REPO):
                problems.append(problem)
    return problems


def test_slug_follows_github() -> None:
    assert slug("The default run (README command 1)") == "the-default-run-readme-command-1"
    assert slug("Where a decode step's time goes (issue 42)") == "where-a-decode-steps-time-goes-issue-42"
    assert slug("`grpo.logprob_chunk_rows`: chunks") == "grpologprob_chunk_rows-chunks"
    assert slug("Code sandbox: time per HumanEval program") == "code-sandbox-time-per-humaneval-program"
    assert slug("A [linked](https://example.com) *word*") == "a-linked-word"


def test_duplicate_headings_are_numbered(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n## Setup\n```\n# not a heading\n```\n## Setup\n## Setup\n", encoding="utf-8")
    assert anchors(page) == {"title", "setup", "setup-1", "setup-2"}


def test_broken_targets_are_named_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md#other-page) [ok](#page) `[code](nowhere.md)`\n"
        "[gone](missing.md)\n[bad anchor](other.md#nope) [in page](#nope)\n"
        '[site](https://example.com/x.md) see other.md, "Other" and other.md, "Missing section"\n',
        encoding="utf-8",
    )
    problems = markdown_problems(page)
    assert len(problems) == 4, problems
    assert f"{page}:3: links to 'missing.md'" in problems[0]
    assert f"{page}:4: links to 'other.md#nope'" in problems[1] and "#nope" in problems[2]
    assert f"{page}:5: cites section 'Missing section' of other.md" in problems[3]


def test_there_are_docs_to_check() -> None:
    names = {path.relative_to(REPO).as_posix() for path in markdown_files()}
    assert {"README.md", "benchmarks/RESULTS.md", "docs/benchmarks.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_markdown_links_resolve(path: Path) -> None:
    problems = markdown_problems(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_config_comment_links_resolve(path: Path) -> None:
    problems = config_problems(path)
    assert not problems, "\n".join(problems)
