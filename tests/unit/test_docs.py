"""The docs a maintainer navigates by: numbered sections run in order, once each."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_numbered_sections_run_in_order() -> None:
    for page in DOCS.glob("*.md"):
        numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", page.read_text(), re.M)]
        assert numbers == list(range(1, len(numbers) + 1)), (page.name, numbers)
