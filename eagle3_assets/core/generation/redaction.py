"""Credentials in server URLs (``http://user:token@host``) never reach a log, a row, metadata or an error.

A base URL may carry credentials for a proxy in front of vLLM (aiohttp sends
them as HTTP basic auth). The client needs them to send requests; everything
a person or a database can read gets the URL without them. One helper for a
URL, one for free text (exception messages, which may quote a URL).
"""

from __future__ import annotations

import re
import urllib.parse

# scheme://userinfo@ anywhere in a text; userinfo is everything up to the last "@" before the host.
_USERINFO_IN_TEXT = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@")


def has_credentials(url: str) -> bool:
    return "@" in urllib.parse.urlsplit(url).netloc


def redact_url(url: str) -> str:
    """``url`` without the ``user:password@`` part of its host (unchanged when it has none)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def redact_credentials(text: str) -> str:
    """Every URL in ``text`` with its credentials removed (for error messages that quote a URL)."""
    return _USERINFO_IN_TEXT.sub(lambda m: m.group("scheme"), text)
