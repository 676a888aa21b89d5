"""Which browsers may talk to the API: DNS-rebinding and cross-site protection. Pure.

The API has no authentication, so a web page the person happens to visit must not be able to
use it. Two checks, on every route (the page, /status, /v1/*, /api/*), and one on every POST:

- Host: a page on `evil.example` whose name is re-pointed at 127.0.0.1 reaches the member with
  `Host: evil.example`. Only IP literals, `localhost` (and `*.localhost`) and this machine's own
  names pass.
- Origin: a browser names the page that sent a request. Absent (curl, SDKs) passes; the member's
  own page (same host and port as the request) passes; a page served from this machine's
  loopback (`http://localhost:3000`, as Ollama allows) passes; anything else, `null` included,
  is refused.
- Content-Type (POST): a browser sends text/plain, multipart/form-data and
  application/x-www-form-urlencoded (or no type at all) to any site without asking it first
  (no CORS preflight), so a page could post a prompt; application/json it sends only after a
  preflight, which this API never grants. So a request that a browser made (it carries an
  Origin header, as every browser POST does, or Sec-Fetch-Site) must be application/json.
  Without either (curl, the openai and ollama clients, scripts) any type passes and the body
  must still be JSON: the README's `curl ... -d '{...}'` sends application/x-www-form-urlencoded.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost",)


def split_host(value: str) -> tuple[str, str]:
    """`host[:port]` or `[v6][:port]` → (lower-case host without brackets or trailing dot, port)."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value.lower(), ""
        host, rest = value[1:end], value[end + 1 :]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return value.lower(), ""
        return host.lower(), rest.removeprefix(":")
    if value.count(":") == 1:
        host, port = value.split(":")
        if not port.isdigit():  # not a port: the whole value, which no check accepts
            return value.lower(), ""
        return host.lower().rstrip("."), port
    return value.lower().rstrip("."), ""


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, own_names: tuple[str, ...] = ()) -> bool:
    return _is_ip(host) or _is_loopback(host) or host in own_names


def refusal(host_header: str | None, origin: str | None, own_names: tuple[str, ...] = ()) -> str | None:
    """None when the request may go on, else the one-line reason it is refused (403)."""
    names = tuple(n.lower().rstrip(".") for n in own_names if n)
    if host_header:
        host, _ = split_host(host_header)
        if not host_allowed(host, names):
            return (f"the Host header {host_header!r} is not an address of this member; use its IP "
                    "address or localhost (protection against DNS rebinding)")  # fmt: skip
    if origin is None:
        return None
    parts = urlsplit(origin.strip())
    if parts.scheme in ("http", "https") and parts.netloc:
        if host_header and parts.netloc.lower() == host_header.strip().lower():
            return None  # the member's own page
        if _is_loopback(split_host(parts.netloc)[0]):
            return None  # a page served from this machine
    return (f"requests from the web page at {origin!r} are refused: only this member's own page "
            "and pages on this machine's loopback may use the API")  # fmt: skip


def content_type_refusal(content_type: str | None, origin: str | None, fetch_site: str | None) -> str | None:
    """None when a POST's body may be read, else the one-line reason it is refused (415)."""
    if origin is None and fetch_site is None:
        return None  # not a browser: no page can have sent it
    media = (content_type or "").split(";")[0].strip().lower()
    if media == "application/json":
        return None
    return (f"a request from a web page must send Content-Type: application/json, not "
            f"{media or 'none'!r} (protection against cross-site requests)")  # fmt: skip


def own_names() -> tuple[str, ...]:
    """This machine's names (its hostname, and the same with `.local` for mDNS)."""
    import socket

    name = socket.gethostname().lower().rstrip(".")
    return (name, f"{name}.local") if name else ()
