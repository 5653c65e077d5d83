"""The rendered tables of BENCHMARKS.md and bench/notes/*.md are those of the committed
result JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import render


def _blocks() -> list[tuple[Path, str]]:
    """(page, block name) of every rendered block, page by page."""
    return [
        (doc, m["name"]) for doc in render.docs() for m in render._BLOCK.finditer(doc.read_text())
    ]


def test_benchmarks_md_tables_match_the_committed_json() -> None:
    names = [name for _, name in _blocks()]
    assert len(names) == len(set(names)), "each block appears on one page, once"
    assert set(names) == set(render.RENDERERS), "every renderer has its block and vice versa"
    assert {name for doc, name in _blocks() if doc == render.DOC}, "BENCHMARKS.md has tables"
    for doc in render.docs():
        text = doc.read_text()
        assert render.render(text) == text, f"run `python -m bench.render` and commit {doc.name}"


@pytest.mark.parametrize(("doc", "name"), _blocks(), ids=[f"{d.name}:{n}" for d, n in _blocks()])
def test_a_changed_number_is_caught(doc: Path, name: str) -> None:
    text = doc.read_text()
    match = next(m for m in render._BLOCK.finditer(text) if m["name"] == name)
    body = match["body"]
    digit = next(i for i, ch in enumerate(body) if ch.isdigit())
    tampered = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1 :]
    changed = text[: match.start("body")] + tampered + text[match.end("body") :]
    assert render.render(changed) != changed


def test_an_unknown_block_is_an_error() -> None:
    with pytest.raises(KeyError):
        render.render("<!-- render:nope -->\nx\n<!-- /render:nope -->")


def test_check_names_a_page_out_of_date(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    page = tmp_path / "notes.md"
    page.write_text("<!-- render:episodes.settings -->\nold\n<!-- /render:episodes.settings -->\n")
    monkeypatch.setattr(render, "docs", lambda: [page])
    assert render.main(["--check"]) == 1
    assert render.main([]) == 0 and render.main(["--check"]) == 0
    assert "old" not in page.read_text()
