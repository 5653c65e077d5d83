"""The deploy suite's tools: the PyPI wrappers in the core venv and Debian's promtool.

`make test-deploy` installs them; run without it, a check fails saying so rather than
skipping, so a missing tool never passes for a clean bill.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    path = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not path or not Path(path).exists():
        pytest.fail("promtool is not installed; `make test-deploy` extracts Debian's")
    return path
