"""How a process proves itself to NATS: the settings' credentials as `nats.connect` options.

One way at a time (user and password, a token, an nkey seed, or a `.creds` file with a
user JWT), plus TLS (a CA to trust, a client certificate and key) with any of them. Secrets
are read from files (`*_file`, mode 0600 by preference) or the environment; a setting that
is given but yields no credential refuses to start, never connects without it.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from tokenway.config import ENV_PREFIX, Settings
from tokenway.errors import CannotStart


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')} ({ENV_PREFIX}{name.upper()})"


def _secret(s: Settings, name: str) -> str | None:
    """A secret given inline or as `<name>_file`; CannotStart when unusable or both."""
    inline, path = getattr(s, name), getattr(s, f"{name}_file")
    if inline is not None and path is not None:
        raise CannotStart(f"give {_flag(name)} or {_flag(name + '_file')}, not both")
    if path is not None:
        inline = _read(path, name + "_file").strip()
    if inline is not None and not inline.strip():
        raise CannotStart(f"{_flag(name)} is set but empty")
    return inline


def _read(path: str, name: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CannotStart(f"cannot read {_flag(name)} {path}: {exc}") from None


def _file(s: Settings, name: str) -> str | None:
    """A file setting: its path, once it is known to be readable."""
    path = getattr(s, name)
    if path is None:
        return None
    _read(path, name)
    return str(Path(path).expanduser())


def connect_options(s: Settings) -> dict[str, Any]:
    """`nats.connect` keyword arguments for who the settings say this process is: its
    credentials (none: an anonymous connection) and its inboxes (none: nats-py's `_INBOX`)."""
    options: dict[str, Any] = {}
    if s.nats_inbox_prefix is not None:
        options["inbox_prefix"] = s.nats_inbox_prefix
    password, token = _secret(s, "nats_password"), _secret(s, "nats_token")
    ways = {
        "user": s.nats_user is not None or password is not None,
        "token": token is not None,
        "nkey": s.nats_nkey_file is not None,
        "creds": s.nats_creds is not None,
    }
    if sum(ways.values()) > 1:
        given = ", ".join(w for w, on in ways.items() if on)
        raise CannotStart(f"NATS credentials: give one way to authenticate, not {given}")
    if ways["user"]:
        if not s.nats_user or password is None:
            raise CannotStart(
                f"NATS credentials: {_flag('nats_user')} and a password "
                f"({_flag('nats_password')} or {_flag('nats_password_file')}) go together"
            )
        options.update(user=s.nats_user, password=password)
    if token is not None:
        options["token"] = token
    if (seed := _file(s, "nats_nkey_file")) is not None:
        options["nkeys_seed"] = seed
    if (creds := _file(s, "nats_creds")) is not None:
        options["user_credentials"] = creds
    if s.nats_tls_ca or s.nats_tls_cert or s.nats_tls_key:
        options["tls"] = _tls(s)
    return options


def _tls(s: Settings) -> ssl.SSLContext:
    if (s.nats_tls_cert is None) != (s.nats_tls_key is None):
        raise CannotStart(
            f"NATS TLS: {_flag('nats_tls_cert')} and {_flag('nats_tls_key')} go together"
        )
    try:
        context = ssl.create_default_context(cafile=_file(s, "nats_tls_ca"))
        cert = _file(s, "nats_tls_cert")
        if cert is not None:
            context.load_cert_chain(cert, _file(s, "nats_tls_key"))
    except ssl.SSLError as exc:
        raise CannotStart(f"NATS TLS: unusable certificate or key: {exc}") from None
    return context
