"""The app's lifespan around the service it builds."""

from __future__ import annotations

import gc
from pathlib import Path

from sampler_service.app import create_app
from sampler_service.config import ServeSettings


async def test_objects_made_before_serving_are_out_of_the_collectors_sight_while_it_serves(
    tmp_path: Path,
) -> None:
    class Service:
        frozen_at_stop = -1

        async def stop(self) -> None:
            self.frozen_at_stop = gc.get_freeze_count()

    service = Service()

    async def build() -> Service:
        return service

    settings = ServeSettings(model=tmp_path, data=[tmp_path / "d.jsonl"], state_dir=tmp_path)
    app = create_app(settings, build)  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0  # start-up's objects: never scanned again
    # given back before the service stops, so what it leaves behind can be collected
    assert service.frozen_at_stop == 0 and gc.get_freeze_count() == 0
