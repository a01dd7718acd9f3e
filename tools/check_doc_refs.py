#!/usr/bin/env python3
"""Check that every citation of the project's documentation points at something real.

Code and docs cite the pages under ``docs/`` as ``docs/<path>.md`` or
``docs/<path>.md#<anchor>``. An anchor is either an explicit ``<a id="...">`` line in
the page (the stable form: code should cite these) or the GitHub slug of one of its
headings. This script fails (exit status 1, one ``file:line: message`` per problem) when:

- a cited page does not exist, or the cited anchor is not in it;
- a relative Markdown link inside a ``.md`` file (``[text](other.md#x)``, ``[text](#x)``)
  points at a missing file or anchor;
- any scanned file refers to the old out-of-tree design document (the ``../shared``
  folder or its ``DESIGN`` page): the repository documents itself;
- a source file (``*.py``, ``*.cpp``, ``*.h``) cites an issue by number ("issue #12", "(#12)"): the code says why in
  words, not by pointing at a tracker.

Scanned: ``*.py``, ``*.cpp``, ``*.h``, ``*.md`` and ``*.toml`` files under ``tidal/``, ``tests/``,
``benchmarks/`` and ``docs/``, plus ``README.md`` and ``pyproject.toml`` at the root.

Usage::

    python tools/check_doc_refs.py                 # the whole repository
    python tools/check_doc_refs.py --docs-only     # only the pages under docs/
    python tools/check_doc_refs.py --list-anchors  # every citable docs/...#anchor
    python tools/check_doc_refs.py --list-anchors docs/architecture.md

Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SCAN_DIRS = ("tidal", "tests", "benchmarks", "docs")
SCAN_ROOT_FILES = ("README.md", "pyproject.toml")
SCAN_SUFFIXES = (".py", ".md", ".toml", ".cpp", ".h")
SKIP_DIR_NAMES = frozenset({"__pycache__", ".git", "build", "node_modules", ".venv"})

# ``docs/<path>.md`` optionally followed by ``#<anchor>``, not preceded by a path character
# (so ``x/docs/a.md`` or ``mydocs/a.md`` is not taken for a citation).
CITATION_RE = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.md)(?:#([\w-]+))?")
# A Markdown link's target: ``](target)`` or ``](target "title")``.
MD_LINK_RE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXPLICIT_ANCHOR_RE = re.compile(r"<a\s+(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE_RE = re.compile(r"^\s*(```|~~~)")
# The out-of-tree design document, in any of the ways it was cited.
_DESIGN = "DESIGN" + ".md"
FORBIDDEN_RE = re.compile(r"\.\./shared|shared/" + re.escape(_DESIGN) + "|" + re.escape(_DESIGN))
# "issue #12", "issues #12", "(#12)" -- not "vllm#123" (another project's thread).
ISSUE_RE = re.compile(r"\bissues?\s*#\d+|\(#\d+\)", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Problem:
    path: str  # relative to the root
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


# ------------------------------------------------------------------------------ anchors


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup dropped, lower case,
    punctuation removed (letters, digits, ``_``, ``-`` and spaces kept), spaces to ``-``."""
    text = re.sub(r"<[^>]+>", "", heading)  # inline HTML
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links -> their text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors_in_text(text: str) -> tuple[list[str], list[str]]:
    """``(explicit anchors, heading slugs)`` of a Markdown text, in order. Headings and
    anchors inside fenced code blocks do not count; repeated slugs get GitHub's ``-1``,
    ``-2`` ... suffixes."""
    explicit: list[str] = []
    slugs: list[str] = []
    seen: dict[str, int] = {}
    in_fence = False
    for line in text.splitlines():
        if FENCE_RE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        explicit.extend(EXPLICIT_ANCHOR_RE.findall(line))
        m = HEADING_RE.match(line)
        if m:
            base = github_slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            slugs.append(base if n == 0 else f"{base}-{n}")
    return explicit, slugs


class AnchorIndex:
    """Anchors of Markdown files, read once each."""

    def __init__(self) -> None:
        self._cache: dict[Path, frozenset[str]] = {}

    def anchors(self, path: Path) -> frozenset[str]:
        path = path.resolve()
        if path not in self._cache:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                text = ""
            explicit, slugs = anchors_in_text(text)
            self._cache[path] = frozenset(explicit) | frozenset(slugs)
        return self._cache[path]


# ------------------------------------------------------------------------------ scanning


def iter_files(root: Path, *, docs_only: bool = False) -> Iterator[Path]:
    """The files to scan, sorted, as absolute paths."""
    dirs = ("docs",) if docs_only else SCAN_DIRS
    found: set[Path] = set()
    for d in dirs:
        base = root / d
        if not base.is_dir():
            continue
        for p in base.rglob("*"):
            if p.suffix in SCAN_SUFFIXES and p.is_file():
                if not any(part in SKIP_DIR_NAMES for part in p.relative_to(root).parts):
                    found.add(p)
    if not docs_only:
        for name in SCAN_ROOT_FILES:
            p = root / name
            if p.is_file():
                found.add(p)
    yield from sorted(found)


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def check_file(path: Path, root: Path, index: AnchorIndex) -> list[Problem]:
    """Every problem in one file."""
    rel = path.relative_to(root).as_posix()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return [Problem(rel, 0, f"cannot read: {e}")]
    problems: list[Problem] = []
    is_md = path.suffix == ".md"
    is_code = path.suffix in (".py", ".cpp", ".h")
    in_fence = False
    for lineno, line in enumerate(text.splitlines(), 1):
        checked: set[tuple[Path, str | None]] = set()
        for m in CITATION_RE.finditer(line):
            target, anchor = root / "docs" / m.group(1), m.group(2)
            checked.add((target.resolve(), anchor))
            problems.extend(_check_target(rel, lineno, m.group(0), target, anchor, index))
        if is_md:
            if FENCE_RE.match(line):
                in_fence = not in_fence
            elif not in_fence:
                for m in MD_LINK_RE.finditer(line):
                    problems.extend(
                        _check_md_link(rel, lineno, m.group(1), path, root, index, checked)
                    )
        for m in FORBIDDEN_RE.finditer(line):
            problems.append(
                Problem(rel, lineno, f"refers to the out-of-tree design document: {m.group(0)!r}")
            )
        if is_code:
            for m in ISSUE_RE.finditer(line):
                problems.append(
                    Problem(rel, lineno, f"cites an issue by number: {m.group(0)!r}; say why")
                )
    return problems


def _check_target(
    rel: str, lineno: int, cited: str, target: Path, anchor: str | None, index: AnchorIndex
) -> list[Problem]:
    if not target.is_file():
        return [Problem(rel, lineno, f"{cited}: no such page")]
    if anchor is not None and target.suffix == ".md" and anchor not in index.anchors(target):
        return [Problem(rel, lineno, f"{cited}: no anchor {anchor!r} in that page")]
    return []


def _check_md_link(
    rel: str,
    lineno: int,
    link: str,
    path: Path,
    root: Path,
    index: AnchorIndex,
    checked: set[tuple[Path, str | None]],
) -> list[Problem]:
    if _is_external(link):
        return []
    file_part, _, anchor = link.partition("#")
    target = path if not file_part else (path.parent / file_part)
    key = (target.resolve(), anchor or None)
    if key in checked:  # the same target, already checked as a docs/ citation
        return []
    if not target.exists():
        return [Problem(rel, lineno, f"link {link}: no such file")]
    if anchor and target.is_file() and target.suffix == ".md":
        if anchor not in index.anchors(target):
            return [Problem(rel, lineno, f"link {link}: no anchor {anchor!r} in that page")]
    return []


def check(root: Path, *, docs_only: bool = False) -> list[Problem]:
    """Every problem under ``root`` (the repository), sorted."""
    root = root.resolve()
    index = AnchorIndex()
    problems: list[Problem] = []
    for path in iter_files(root, docs_only=docs_only):
        problems.extend(check_file(path, root, index))
    return sorted(problems)


def list_anchors(root: Path, pages: Iterable[str] = ()) -> list[str]:
    """``docs/<page>.md#<anchor>`` for every explicit anchor of the pages (default: every
    page under docs/), then, marked ``(heading)``, the heading slugs not also explicit."""
    root = root.resolve()
    paths = [root / p for p in pages] or sorted((root / "docs").rglob("*.md"))
    out: list[str] = []
    for p in paths:
        explicit, slugs = anchors_in_text(p.read_text(encoding="utf-8"))
        rel = p.resolve().relative_to(root).as_posix()
        out.extend(f"{rel}#{a}" for a in explicit)
        out.extend(f"{rel}#{s}  (heading)" for s in slugs if s not in explicit)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this script's parent folder's parent)",
    )
    parser.add_argument("--docs-only", action="store_true", help="check only the pages under docs/")
    parser.add_argument(
        "--list-anchors",
        nargs="*",
        metavar="PAGE",
        help="print the citable anchors of these pages (default: every docs/ page) and exit",
    )
    ns = parser.parse_args(argv)
    if ns.list_anchors is not None:
        for line in list_anchors(ns.root, ns.list_anchors):
            print(line)
        return 0
    problems = check(ns.root, docs_only=ns.docs_only)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
