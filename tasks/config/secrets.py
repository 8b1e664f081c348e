"""Credentials inside URIs: found (the config refuses them) and redacted (every URI the run writes or logs).

A tracking URI may carry a secret: ``https://user:password@host``, ``https://TOKEN@host`` or ``...?token=X``.
The config refuses them by name (tasks/config/load.py); $MLFLOW_TRACKING_URI may still hold one, and its real
value then stays only in the process environment: run.json, stage_runs.json, the GRPO launch spec and log lines
carry :func:`redact` of it, and a reader that needs the real URI back gets it from the environment with
:func:`unredact` (its redaction must match what was written).
"""

from __future__ import annotations

import os
import re

MASK = "***"
# scheme://userinfo@ : the userinfo (user:password, or a token alone) up to the first '@' of the authority
_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)([^/@\s?#]+)@", re.IGNORECASE)
# ?name=value / &name=value whose name says it is secret (token, access_token, key, sig, X-Amz-Signature, ...)
_SECRET_PARAM = re.compile(
    r"([?&;][^=&#\s]*(?:token|secret|passw(?:or)?d|pwd|key|signature|sig|credential|auth)[^=&#\s]*=)([^&#\s]+)",
    re.IGNORECASE,
)


def uri_credentials(value: str) -> str | None:
    """What kind of credential ``value`` (a URI) holds, for an error message: 'a user:password', 'a user or
    token', 'a secret query parameter'; None when it holds none."""
    if m := _USERINFO.match(value.strip()):
        return "a user:password" if ":" in m.group(2) else "a user name or token"
    if "://" in value and _SECRET_PARAM.search(value):
        return "a secret query parameter"
    return None


def redact(text: str) -> str:
    """``text`` (a URI, or a message with URIs in it) with userinfo and secret query values replaced by ***."""
    if not text:
        return text
    return _SECRET_PARAM.sub(rf"\1{MASK}", _USERINFO.sub(rf"\1{MASK}@", text))


def unredact(written: str | None, *candidates: str | None, env: str = "MLFLOW_TRACKING_URI") -> str | None:
    """The real URI behind ``written`` (a value :func:`redact` wrote to a file): the first of ``candidates`` (URIs
    the caller was given) and $``env`` whose redaction is ``written``; ``written`` itself when nothing in it was
    redacted or no candidate matches."""
    if not written or MASK not in written:
        return written
    for real in (*candidates, os.environ.get(env)):
        if real and redact(real) == written:
            return real
    return written


def real_uri(written: str, *candidates: str | None, who: str, also: str = "") -> str:
    """:func:`unredact` of ``written`` for a caller that must connect: a ValueError naming ``who`` and where the real
    URI goes (``$MLFLOW_TRACKING_URI``, then ``also``) when no candidate holds it, instead of a connection attempt
    to a URI with ``***`` in it."""
    uri = unredact(written, *candidates)
    if MASK in uri:
        raise ValueError(
            f"{written}: its credentials were redacted where it was written; {who} needs the real URI in "
            f"$MLFLOW_TRACKING_URI{also}"
        )
    return uri


def without_userinfo(uri: str) -> str:
    """``uri`` without its ``user[:password]@`` (urllib would take it for part of the host name); for a probe that
    needs no login: any HTTP answer, 401 included, tells that the server is there."""
    return _USERINFO.sub(r"\1", uri, count=1)
