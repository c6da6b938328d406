"""Whether a server speaks TLS: asked after a plain (http://, ws://) request was hung up
on, so that the error can say "is it https?" rather than that no answer came."""

from __future__ import annotations

import socket
import ssl
import urllib.parse


def speaks_tls(url: str, timeout: float = 1.0) -> bool:
    """Whether the server at an http:// (or ws://) URL completes a TLS handshake, and so
    wanted https:// (wss://): a TLS server hangs up on a plain request, and the client saw
    only that.
    Asked only after a request failed so; nothing is sent but the handshake, and no
    certificate is trusted or checked (the question is only which protocol it speaks).
    A TLS server answers a ClientHello at once; a plain one that waits for a request line
    would hold the error back for the whole ``timeout``, so it is short."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "ws") or not parts.hostname:
        return False
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout) as sock:
            with context.wrap_socket(sock, server_hostname=parts.hostname):
                return True
    except (OSError, ValueError):
        return False
