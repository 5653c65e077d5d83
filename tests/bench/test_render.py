"""BENCHMARKS.md's rendered tables are those of the committed result JSON."""

from __future__ import annotations

import pytest

from bench import render


def test_benchmarks_md_tables_match_the_committed_json() -> None:
    text = render.DOC.read_text()
    names = {m["name"] for m in render._BLOCK.finditer(text)}
    assert names == set(render.RENDERERS), "every renderer has its block and vice versa"
    assert render.render(text) == text, "run `python -m bench.render` and commit the result"


@pytest.mark.parametrize(
    "name", sorted({m["name"] for m in render._BLOCK.finditer(render.DOC.read_text())})
)
def test_a_changed_number_is_caught(name: str) -> None:
    text = render.DOC.read_text()
    match = next(m for m in render._BLOCK.finditer(text) if m["name"] == name)
    body = match["body"]
    digit = next(i for i, ch in enumerate(body) if ch.isdigit())
    tampered = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1 :]
    changed = text[: match.start("body")] + tampered + text[match.end("body") :]
    assert render.render(changed) != changed


def test_an_unknown_block_is_an_error() -> None:
    with pytest.raises(KeyError):
        render.render("<!-- render:nope -->\nx\n<!-- /render:nope -->")
