"""The session page at GET /: static files shipped in the package (kafila/api/static/).

The page draws the ring, the members table and the live figures from this member's own
`/status` (polled every second) and chats through its own `/v1/chat/completions`. Nothing is
fetched from anywhere else: the Content-Security-Policy header allows only this origin, so a
browser refuses any other address even if the page asked for one.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

# name under /static/ → content type; nothing else is served from the folder
STATIC_FILES = {
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("kafila.api").joinpath("static", name).read_bytes()


def add_page_routes(router: web.UrlDispatcher) -> None:
    """GET / (the page) and GET /static/{name} (its script, style and icon)."""
    files = {name: _read(name) for name in ("index.html", *STATIC_FILES)}

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=files["index.html"], content_type="text/html", charset="utf-8",
                            headers=PAGE_HEADERS)  # fmt: skip

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound()
        return web.Response(body=files[name], headers={**PAGE_HEADERS, "Content-Type": STATIC_FILES[name]})

    router.add_get("/", page)
    router.add_get("/static/{name}", static)
