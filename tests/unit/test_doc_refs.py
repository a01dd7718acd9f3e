"""tools/check_doc_refs.py on small temporary trees: never on the repository itself, so
these tests hold whatever state the real docs and code are in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# Built, not written out: the real checker scans this file too, and these citations
# point into the temporary trees, not at the repository's pages.
D = "docs" + "/"

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_doc_refs.py"


@pytest.fixture(scope="module")
def refs():
    spec = importlib.util.spec_from_file_location("check_doc_refs", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_doc_refs"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PAGE = """# Title

<a id="engine-loop"></a>
## The busy loop, step by step

Text. See [the other page](other.md#ring-states) and [below](#the-busy-loop-step-by-step).

```
## not a heading
<a id="not-an-anchor"></a>
```
"""
OTHER = '<a id="ring-states"></a>\n## Ring\n'


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return tmp_path


def _base(tmp_path: Path, code: str) -> Path:
    return _tree(
        tmp_path,
        {D + "architecture.md": PAGE, D + "other.md": OTHER, "tidal/mod.py": code},
    )


def test_good_citations_pass(refs, tmp_path):
    root = _base(
        tmp_path,
        f'"""See {D}architecture.md#engine-loop and {D}other.md."""\n'
        f"# {D}architecture.md#the-busy-loop-step-by-step (a heading slug)\n",
    )
    assert refs.check(root) == []
    assert refs.main(["--root", str(root)]) == 0


def test_missing_anchor_fails(refs, tmp_path):
    root = _base(tmp_path, f"# {D}architecture.md#no-such-anchor\n")
    problems = refs.check(root)
    assert [(p.path, p.line) for p in problems] == [("tidal/mod.py", 1)]
    assert "no-such-anchor" in problems[0].message
    assert refs.main(["--root", str(root)]) == 1


def test_missing_page_fails(refs, tmp_path):
    root = _base(tmp_path, f"# {D}nope.md#engine-loop\n")
    (problem,) = refs.check(root)
    assert "no such page" in problem.message


def test_anchor_inside_a_code_fence_does_not_count(refs, tmp_path):
    root = _base(tmp_path, f"# {D}architecture.md#not-an-anchor\n")
    assert len(refs.check(root)) == 1


def test_design_document_citation_fails(refs, tmp_path):
    design, shared = "DESIGN" + ".md", ".." + "/shared"  # built: this file cites neither
    root = _base(tmp_path, f"# see {design} 6.5\n# and {shared}/peers\n")
    problems = refs.check(root)
    assert [p.line for p in problems] == [1, 2]
    assert all("design document" in p.message for p in problems)


def test_issue_numbers_in_python_fail(refs, tmp_path):
    hash_ = "#"
    root = _base(tmp_path, f"# measured for issue {hash_}25\nx = 1  # fixed ({hash_}12)\n")
    problems = refs.check(root)
    assert [p.line for p in problems] == [1, 2]
    # Another project's thread is a citation in words, not this project's issue number.
    root2 = _base(tmp_path / "b", f"# vllm{hash_}53947 does it differently\n")
    assert refs.check(root2) == []
    # C++ sources too.
    root3 = _tree(tmp_path / "c", {"tidal/k.cpp": f"// Why (issue {hash_}13): speed\n"})
    assert [(p.path, p.line) for p in refs.check(root3)] == [("tidal/k.cpp", 1)]


def test_broken_relative_link_in_docs_fails(refs, tmp_path):
    root = _tree(
        tmp_path,
        {D + "a.md": "[x](b.md#gone) [y](missing.md) [z](https://example.com/#q)\n",
         D + "b.md": "# B\n"},
    )  # fmt: skip
    messages = [p.message for p in refs.check(root, docs_only=True)]
    assert len(messages) == 2
    assert "gone" in messages[0] and "missing.md" in messages[1]


def test_docs_only_ignores_the_code(refs, tmp_path):
    root = _base(tmp_path, f"# {D}architecture.md#no-such-anchor\n")
    assert refs.check(root, docs_only=True) == []


def test_github_slugs(refs):
    assert refs.github_slug("6.5 Rank death, and `ranks` that stop!") == (
        "65-rank-death-and-ranks-that-stop"
    )
    explicit, slugs = refs.anchors_in_text("# A\n## A\n<a id='x-y'></a>\n")
    assert explicit == ["x-y"] and slugs == ["a", "a-1"]


def test_list_anchors(refs, tmp_path, capsys):
    root = _base(tmp_path, "")
    assert refs.main(["--root", str(root), "--list-anchors"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"{D}architecture.md#engine-loop" in out
    assert f"{D}other.md#ring-states" in out
