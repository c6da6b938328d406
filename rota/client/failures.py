"""What a failed request means to a client's caller: the ApiError of an answer that is
an error, a web page or none at all, in words a program can act on (the CLI puts its
flags in, rota/cli/base.py)."""

from __future__ import annotations

from typing import Any

from rota.base.errors import ApiError
from rota.base.ids import dashboard_base
from rota.base.tls import distrust, plain_answer, plain_url, speaks_tls

READS = frozenset({"GET", "HEAD"})


def transport_error(url: str, exc: BaseException, *, connected: bool, method: str = "POST",
                    probe: bool = True) -> ApiError:
    """What a failed request means to its caller, in words it can act on. Before the
    connection is made nothing was sent ("unreachable"); after it, the server may have
    carried the request out and only its answer was lost ("no_answer"): an enqueue may be
    stored, and repeating it with the same job id is the safe way to find out. A read
    changes nothing, and is simply asked again. An http:// URL whose server hung up
    without a word may be a TLS server's (``probe``: ask it for a TLS handshake); an
    https:// URL whose handshake got plain text back is a plain server's."""
    detail = str(exc) or type(exc).__name__
    if (untrusted := distrust(exc)) is not None:
        return ApiError(None, "untrusted_certificate", f"Rota at {url} has {untrusted}")
    if plain_answer(url, exc):
        return ApiError(None, "http_expected", f"Rota at {url} does not speak TLS: is it"
                        f" http://? (use {plain_url(url)})")
    if not connected:
        return ApiError(None, "unreachable", f"cannot reach Rota at {url}: {detail}; is the"
                        f" server running? {URL_HINT}")
    if probe and not isinstance(exc, TimeoutError) and speaks_tls(url):
        return ApiError(None, "https_expected", f"Rota at {url} answers only TLS: is it"
                        f" https? (use {'https' + url[len('http'):]})")
    what = "timed out" if isinstance(exc, TimeoutError) else detail
    if method in READS:
        return ApiError(None, "no_answer", f"no answer from Rota at {url} ({what}); a read"
                        " changes nothing: ask again once the server answers")
    return ApiError(None, "no_answer", f"no answer from Rota at {url} ({what}): the request"
                    " may have been carried out; repeat it with the same job id to be sure")


# The library's advice (a program passes url=); the CLI says its flag instead.
URL_HINT = "(is the url given its address?)"


# What an answer that is no JSON error looks like when the URL is not the API's base:
# the dashboard (/ui), a proxy's or another site's page. The API never redirects.
PAGE_STARTS = (b"<!doctype html", b"<html", b"<?xml", b"<head", b"<body")


def not_the_api(url: str, status: int, content: bytes) -> ApiError | None:
    """The error of an answer from a web page rather than Rota's API, or None."""
    if 300 <= status < 400:
        what = f"with a redirect (HTTP {status})"
    elif content.lstrip()[:20].lower().startswith(PAGE_STARTS):
        what = "with a web page"
    else:
        return None
    return ApiError(status, "not_the_api", f"{url} answers {what}, not Rota's API:"
                    " use the server's base URL, such as http://127.0.0.1:8000")


def dashboard_url(url: str) -> ApiError | None:
    """The not_the_api error of a base URL whose path is the dashboard's (``/ui`` or
    under it), or None. Every request through it would miss the API: a read gets a
    page, a write is refused as a browser's cross-site request (issue 22). So it is said
    before anything is sent, with the base URL to give instead."""
    if (base := dashboard_base(url)) is None:
        return None
    return ApiError(None, "not_the_api", f"{url} is the dashboard's address, not Rota's API:"
                    f" use the server's base URL, {base}")


def refusal(status: int, answer: Any, content: bytes, *, token: bool | None = None,
            url: str = "the server") -> ApiError:
    """The ApiError of an HTTP error answer: the server's JSON error, or the text.
    ``token``: whether the caller sent one (None: unknown), to say a 401 in its words."""
    err = answer.get("error", {}) if isinstance(answer, dict) else {}
    err = err if isinstance(err, dict) else {}
    if not err and (page := not_the_api(url, status, content)) is not None:
        return page
    text = content.decode(errors="replace").strip() or f"HTTP {status}"
    code, message = err.get("code", "http_error"), err.get("message", text)
    if code == "unauthorized" and token is not None:
        message = TOKEN_REFUSED if token else TOKEN_WANTED
    return ApiError(status, code, message)


TOKEN_WANTED = ("the server wants a token: pass token= or set ROTA_TOKEN (one from 'rota tokens"
                " create')")
TOKEN_REFUSED = ("the server refused the token given: it may have been revoked, be mistyped,"
                 " or have been made by a server on another database ('rota tokens list' shows"
                 " the live ones)")
