"""The API document is the reference: schemathesis fuzzes every operation but the stream
(which has its own tests) and the dashboard's static files against a live toy sampler
with an API key, all checks on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import Server, start_server

pytestmark = [pytest.mark.api, pytest.mark.timeout(1200)]

HERE = Path(__file__).parent
KEY = "schemathesis-key"
LEASE_WAIT_S = 2.0


@pytest.fixture
def sampler(toy: Any, tmp_path: Path) -> Iterator[Server]:
    # The engine in its own process, as served by default. The fuzzer leases without
    # training: BASE_CONFIG leaves staleness unbounded.
    server = start_server(
        toy,
        tmp_path,
        {"max_active_prompts": 8, "max_buffered_groups": 32},
        # Long polls are capped so that a fuzzed wait_s of minutes on an empty queue
        # (every group leased, never acked) does not stretch the run.
        extra=["--api-key", KEY, "--max-lease-wait-s", str(LEASE_WAIT_S)],
        engine="process",
    )
    yield server
    server.stop()


def test_every_operation_conforms_to_the_document(sampler: Any, tmp_path: Path) -> None:
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert cli, "schemathesis is not installed (pip install -e '.[dev]')"
    done = subprocess.run(
        [
            cli,
            "--config-file",
            str(HERE / "schemathesis.toml"),
            "run",
            f"{sampler.url}/openapi.json",
            "--checks",
            "all",
            "--header",
            f"Authorization: Bearer {KEY}",
            "--max-examples",
            "50",
            "--exclude-path",
            "/v1/groups/stream",
            # The dashboard's HTML page and static assets are checked by the browser suite.
            "--exclude-path-regex",
            "^/dashboard",
            "--workers",
            "1",
            "--seed",
            "0",
            "--request-timeout",
            "120",
            "--report",
            "junit",
            "--report-dir",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    # The server is still healthy after the fuzzing.
    assert httpx.get(f"{sampler.url}/health", timeout=60).json()["status"] == "ok"
