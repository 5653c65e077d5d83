"""The README's harness is the example file's, line for line (the session tests run that
file, so the README shows code that runs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_harness_is_the_example_files() -> None:
    readme = (ROOT / "README.md").read_text().split("## Agent harnesses", 1)[1]
    block = re.search(r"```python\n(.*?)```", readme, re.S)
    assert block, "no python block in the README's harness section"
    example = (ROOT / "examples" / "calculator_harness.py").read_text()
    for line in block.group(1).splitlines():
        code = line.split("  # ", 1)[0].rstrip()
        assert code in example, f"README line not in examples/calculator_harness.py: {line!r}"
