"""Pages the sampler serves from its own package data (the dashboard, the API docs): an
HTML page at a path and the assets it loads beside it, nothing else, each response with
the page's headers (its Content-Security-Policy)."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from sampler_service.errors import ServiceError


def package_pages(
    package: str,
    path: str,
    assets: Mapping[str, str],
    headers: Mapping[str, str],
    *,
    include_in_schema: bool = True,
) -> APIRouter:
    """GET `path` answers the package's index.html; GET `path/NAME` the asset NAME, one of
    `assets` (name -> media type)."""
    files = resources.files(package)
    cache: dict[str, bytes] = {}

    def read(name: str) -> bytes:
        if name not in cache:
            cache[name] = files.joinpath(name).read_bytes()
        return cache[name]

    router = APIRouter(include_in_schema=include_in_schema)

    @router.get(path, response_class=Response)
    async def page() -> Response:
        return Response(
            read("index.html"), media_type="text/html; charset=utf-8", headers=dict(headers)
        )

    @router.get(
        path + "/{name}",
        response_class=Response,
        responses={404: {"description": "no such asset"}},
    )
    async def asset(name: str) -> Response:
        if name not in assets:
            raise ServiceError(404, "not_found", f"no asset {name!r} under {path}")
        return Response(read(name), media_type=assets[name], headers=dict(headers))

    return router
