"""The API reference at /docs: Swagger UI served by the sampler itself, so it works on a
machine with no network (FastAPI's default page loads its scripts from a CDN).

Swagger UI (Apache-2.0, see swagger-ui.LICENSE, swagger-ui.NOTICE and, for the libraries
its bundle includes, swagger-ui-bundle.LICENSE) ships in this package, from the npm
package swagger-ui-dist 5.35.0. The page reads /openapi.json; like FastAPI's own docs
routes, these are not part of the document they show.
"""

from __future__ import annotations

from fastapi import APIRouter

from sampler_service.pages import package_pages

#: Files the page may load, with their media types; nothing else is served.
ASSETS = {
    "init.js": "text/javascript; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui.LICENSE": "text/plain; charset=utf-8",
    "swagger-ui.NOTICE": "text/plain; charset=utf-8",
    "swagger-ui-bundle.LICENSE": "text/plain; charset=utf-8",
}
# Swagger UI sets inline styles and shows inline SVG; scripts and requests stay on 'self'.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}


def create_docs_router() -> APIRouter:
    return package_pages(__name__, "/docs", ASSETS, HEADERS, include_in_schema=False)
