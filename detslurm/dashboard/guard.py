"""The access check in front of every web server det starts on localhost (the dashboard's
Starlette app, TensorBoard's WSGI app): the request's Host must be a loopback name (a page
elsewhere cannot reach the server by DNS rebinding), and it must carry the token printed with
the URL, as ``?token=`` on the first visit and in a cookie after that.

The cookie is not private to the port (browsers share 127.0.0.1's cookies across ports); what
keeps it from a neighbour is that every port det prints is bound before it is printed, and its
name carries the port, so two servers never overwrite each other's token."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

LOOPBACK = ("127.0.0.1", "localhost", "::1")
NOT_LOCAL = "refused: this server answers only to localhost"


def host_ok(host: str) -> bool:
    """Whether a Host header names the loopback. The browser sends the name it resolved: a
    hostile page whose name now points at 127.0.0.1 shows up here with its own name."""
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", 1)[0]
    return name in LOOPBACK


def token_ok(token: str, *given: str) -> bool:
    """Whether any of the given values is the token. Any one may match: a cookie an earlier
    server left (same name, old token) must not shadow the fresh URL's query token. Constant
    time: the comparison must not tell a guesser how many leading characters were right."""
    return any(hmac.compare_digest(g.encode(), token.encode()) for g in given if g)


def problem(host: str, token: str, *given: str, what: str) -> str | None:
    """Why a request is refused (None: let it through). ``what`` names the command whose
    printed URL has the token."""
    if not host_ok(host):
        return NOT_LOCAL
    if not token_ok(token, *given):
        return f"missing or wrong token: open the URL `{what}` printed"
    return None


def cookie_header(name: str, token: str) -> str:
    """The Set-Cookie value: script-proof (HttpOnly) and never sent by another site's page."""
    return f"{name}={token}; HttpOnly; Path=/; SameSite=strict"


StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class WsgiGuard:
    """The check as WSGI middleware (TensorBoard's app). The first visit's ``/?token=`` is
    answered with a redirect that moves the token into the cookie, out of the address bar."""

    def __init__(self, app: WsgiApp, token: str, cookie: str, what: str) -> None:
        self.app, self.token, self.cookie, self.what = app, token, cookie, what

    def __call__(self, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", "")).get("token", [""])[0]
        try:
            jar = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        except CookieError:
            jar = SimpleCookie()
        held = jar[self.cookie].value if self.cookie in jar else ""
        why = problem(environ.get("HTTP_HOST", ""), self.token, query, held, what=self.what)
        if why:
            start("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [why.encode()]
        if query and environ.get("PATH_INFO", "/") == "/" and environ.get("REQUEST_METHOD") == "GET":
            start("303 See Other", [("Location", "/"), ("Set-Cookie", cookie_header(self.cookie, self.token))])
            return [b""]
        return self.app(environ, start)
