"""The live-run dashboard: one static page served by the sampler itself.

The page and its assets carry no data and need no key; the page's script reads
/health, /v1/stats, /v1/config and /v1/events (with the API key the user types in, when
the sampler has one) and sends PATCH /v1/config. Nothing is fetched from another origin:
the chart library (uPlot, MIT, see uPlot.LICENSE) ships in this package, and the
Content-Security-Policy below makes the browser refuse anything else.
"""

from __future__ import annotations

from fastapi import APIRouter

from sampler_service.pages import package_pages

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


def create_dashboard_router() -> APIRouter:
    return package_pages(__name__, "/dashboard", ASSETS, HEADERS)
