"""The live-run dashboard: one static page served by the sampler itself.

The page and its assets carry no data and need no key; the page's script reads
/health, /v1/stats, /v1/config and /v1/events (with the API key the user types in, when
the sampler has one) and sends PATCH /v1/config. Nothing is fetched from another origin:
the chart library (uPlot, MIT, see uPlot.LICENSE) ships in this package, and the
Content-Security-Policy below makes the browser refuse anything else.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from sampler_service.service import ServiceError

#: Files the page may load, with their media types; nothing else is served.
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@functools.cache
def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def create_dashboard_router() -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", response_class=Response)
    async def page() -> Response:
        return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)

    @router.get(
        "/dashboard/{name}",
        response_class=Response,
        responses={404: {"description": "no such asset"}},
    )
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise ServiceError(404, "not_found", f"no dashboard asset {name!r}")
        return Response(_read(name), media_type=ASSETS[name], headers=HEADERS)

    return router
