"""Passwords kept out of every record: taken out of a URI when the configuration is read, kept in
this process's memory only (for the connection that needs them), and removed from any text the
product writes (an error line, a log record, a tag).

``take_password`` takes the password out of a ``postgresql://`` (or ``http(s)://``) URI and
remembers it under the URI without it; ``password_for`` gives it back to the code that connects.
``redact`` removes passwords from text: every password it was given (raw, percent-encoded, escaped),
the password part of every ``scheme://user:password@...`` in it, and libpq's ``password=...``.
A password may hold any character (``/``, ``@``, ``:``, ``#``, ``?``, ``%``, spaces), so URIs are
read on the raw text, never by a URI parser that would end the user part at the first ``/`` or
``#``: the user part runs to the last ``@`` of the URI. Where that over-redacts (an ``@`` later on
the same line), the text loses a few characters; no password is ever left.
"""

from __future__ import annotations

import json
import re
import threading
from urllib.parse import quote, quote_plus, unquote

MASK = "***"
TAKEN_SCHEMES = ("postgresql", "postgres", "http", "https")  # the URIs whose password take_password takes
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# a URI starts a new one only after one of these (a scheme inside a password is part of the password)
_URI_BEFORE = frozenset(" \t\r\n\"'`<>()[]{},;=|")
_LINE_END = re.compile(r"[\r\n]")
# libpq's keyword form: password='...' (quoted, backslash escapes, a doubled quote too; unterminated:
# to the end) or password=... up to whitespace; PGPASSWORD=... too
_KEYWORD = re.compile(r"(password\s*=\s*)('(?:\\.|''|[^'\\])*(?:'|\\)?|\S*)", re.IGNORECASE)
# a password written percent-encoded: only the characters a URI's user part may hold as they are
_ENCODED = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*")
_PERCENT = re.compile(r"%[0-9A-F]{2}")

_lock = threading.Lock()
_passwords: dict[str, str] = {}  # URI without its password -> the password
_secrets: set[str] = set()  # every form of every password taken, removed from text by redact


def take_password(uri: str) -> str:
    """``uri`` without its password (the user kept); the password is remembered in this process
    (``password_for``) and removed from any text by ``redact``. Only ``postgresql://``,
    ``postgres://``, ``http://`` and ``https://`` URIs; anything else is returned as it is.
    Percent-encoded passwords are remembered decoded; one written raw (``/``, ``@``, ``#``, a
    space... as they are) as written. Never raises."""
    clean, password, written = _split(uri)
    if password is not None:
        with _lock:
            _passwords[clean] = password
            _secrets.update(_forms(password) | _forms(written))
    return clean


def password_for(uri: str) -> str | None:
    """The password taken from ``uri`` (a URI without its password, as ``take_password``
    returned it; or one with a password, which is then the answer), or None."""
    clean, password, _ = _split(uri)
    if password is not None:
        return password
    with _lock:
        return _passwords.get(clean)


def with_password(uri: str) -> str:
    """``uri`` with the password ``take_password`` took from it put back (percent-encoded), for the
    one call that connects (a library that reads credentials only from its URI); never for a
    record. A URI without a password taken is returned as it is."""
    from urllib.parse import quote

    password = password_for(uri)
    clean, inline, _ = _split(uri)
    if password is None or inline is not None:
        return uri
    scheme = _SCHEME.match(clean)
    at = clean.rfind("@")
    if scheme is None or at < scheme.end():
        return uri
    return f"{clean[:at]}:{quote(password, safe='')}{clean[at:]}"


def redact(text: str) -> str:
    """``text`` with every password replaced by ``***``: each password ``take_password`` took
    (raw, percent-encoded, JSON- or repr-escaped), the password part of each ``scheme://user:
    password@...`` (the user part running to the URI's last ``@``) and libpq's ``password=...``."""
    if not text:
        return text
    text = str(text)
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, MASK)
    return _KEYWORD.sub(lambda m: m.group(1) + MASK, _redact_uris(text))


def _split(uri: str) -> tuple[str, str | None, str]:
    """(the URI without its password, the password or None, the password as written)."""
    if not isinstance(uri, str):
        return uri, None, ""
    scheme = _SCHEME.match(uri)
    if scheme is None or scheme.group(0)[:-3].lower() not in TAKEN_SCHEMES:
        return uri, None, ""
    start = scheme.end()
    at = uri.rfind("@", start)
    colon = uri.find(":", start, at) if at >= 0 else -1
    if colon < 0:
        return uri, None, ""
    written = uri[colon + 1:at]
    clean = uri[:colon] + uri[at:]
    if not written:  # user:@host: an empty password is no password
        return clean, None, ""
    return clean, _decoded(written), written


def _decoded(written: str) -> str:
    """The password a URI's user part holds: percent-decoded (as libpq reads it) where it is
    written as a URI's user part may hold it and decodes to text; else as written (a raw password
    with ``/``, ``@``, a space, or a ``%`` that starts no encoded character)."""
    if not _ENCODED.fullmatch(written):
        return written
    try:
        return unquote(written, errors="strict")
    except UnicodeDecodeError:
        return written


def _redact_uris(text: str) -> str:
    starts = [m for m in _SCHEME.finditer(text) if m.start() == 0 or text[m.start() - 1] in _URI_BEFORE]
    pieces, done = [], 0
    for i, scheme in enumerate(starts):
        begin = scheme.end()
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        line_end = _LINE_END.search(text, begin, end)
        end = line_end.start() if line_end else end
        at = text.rfind("@", begin, end)
        colon = text.find(":", begin, at) if at >= 0 else -1
        if colon < 0:
            continue
        pieces += [text[done:colon + 1], MASK]
        done = at
    return "".join(pieces) + text[done:]


def _forms(secret: str) -> set[str]:
    """The ways ``secret`` can appear in text: as it is, percent-encoded (upper- and lowercase
    hex), escaped in JSON or a Python repr."""
    if not secret:
        return set()
    forms = {secret, quote(secret, safe=""), quote(secret), quote(secret, safe="!$&'()*+,;="), quote_plus(secret),
             json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1], repr(secret)[1:-1]}
    forms |= {_PERCENT.sub(lambda m: m.group(0).lower(), form) for form in forms}
    return {form for form in forms if form}
