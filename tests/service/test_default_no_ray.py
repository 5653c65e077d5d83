"""The default sampler (one engine, no Ray address) never imports Ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent(
    """
    import asyncio, functools, sys
    from pathlib import Path

    from sampler_service import cli  # the serve command's module, with its flags
    from sampler_service.app import create_app
    from sampler_service.config import ReplicaSettings, ServeSettings
    from sampler_service.service import SamplerService

    async def main() -> None:
        settings = ServeSettings(
            model=Path(sys.argv[1]), data=[Path(sys.argv[2])], state_dir=Path(sys.argv[3]),
            replica=ReplicaSettings(count=1),
        )
        create_app(settings, functools.partial(SamplerService.build, settings))
        service = await SamplerService.build(settings)
        await service.stop()

    asyncio.run(main())
    print("ray imported:", "ray" in sys.modules)
    """
)


def test_default_serve_never_imports_ray(toy: Any, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(toy.model_dir), str(toy.data_files[0]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ray imported: False" in done.stdout, done.stdout
