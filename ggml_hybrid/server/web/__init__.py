"""The chat page at ``/``: three static files of this package (``index.html``, ``app.js``, ``style.css``), no build
step and nothing fetched from elsewhere (the machine may have no internet). docs/serve.md says how to use it.

``GET /`` answers the page to a browser (``Accept`` naming ``text/html``) and the API's 404 to anything else. The
page and its two files carry no data: they are served without an API key (``auth.OPEN_PATHS``); the page asks for
the key when the server answers its first call with a 401, and sends it on every call. Each file is sent with a
Content-Security-Policy that allows scripts and styles from this server only, no inline script, no ``eval``, no
frames, no form posts, and connections to this server only: a model's answer, which the page renders as text nodes
(``app.js``), could not run a script even if it reached the DOM as markup.
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/web/style.css": ("style.css", "text/css; charset=utf-8")}
PAGE_PATHS = frozenset(FILES)  # what a browser fetches before it knows a key


def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def wants_html(accept: str) -> bool:
    """Whether an ``Accept`` header asks for a page: it names ``text/html`` (a browser's navigation does)."""
    return any(part.split(";")[0].strip().lower() == "text/html" for part in accept.split(","))


class PageRoutes:
    """``GET /`` (to a browser), ``/web/app.js`` and ``/web/style.css``, read once from the package."""

    def __init__(self) -> None:
        self.files = {path: (_read(name), ctype) for path, (name, ctype) in FILES.items()}

    def table(self) -> list[Route]:
        return [Route(path, self.serve, methods=["GET"]) for path in FILES]

    async def serve(self, request: HTTPRequest) -> Response:
        path = request.url.path
        if path == "/" and not wants_html(request.headers.get("accept", "")):
            raise HTTPException(404)  # an API client at the root: the API's 404, as before the page
        body, ctype = self.files[path]
        return Response(body, media_type=ctype, headers={
            "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache"})


__all__ = ["CSP", "PAGE_PATHS", "PageRoutes", "wants_html"]
