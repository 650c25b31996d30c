"""NATS identities for tests: nkeys, and the operator → account → user JWT chain that a
`.creds` file carries (what `nsc` makes), signed here with the nkeys library."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time

import nkeys


def new_key(prefix: int) -> nkeys.KeyPair:
    """A fresh nkey of the kind `prefix` names (operator, account, user)."""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def public(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT (v2 claims) of `subject`, signed by `issuer`."""
    claims: dict[str, object] = {
        "jti": "", "iat": int(time.time()), "iss": public(issuer), "name": name,
        "sub": subject, "nats": {**nats, "version": 2},
    }  # fmt: skip
    digest = hashlib.new("sha512_256", json.dumps(claims).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = f"{header}.{_b64(json.dumps(claims).encode())}"
    return f"{body}.{_b64(issuer.sign(body.encode()))}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


def operator_mode() -> tuple[dict[str, object], str]:
    """A server configuration trusting a new operator with a JetStream-enabled account
    (and the system account JetStream needs), and the `.creds` text of a user of it."""
    operator = new_key(nkeys.PREFIX_BYTE_OPERATOR)
    system = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    account = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    user = new_key(nkeys.PREFIX_BYTE_USER)
    limits = {**UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1}
    storage = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    accounts = {
        public(system): jwt(operator, public(system), "SYS", {"type": "account",
                                                              "limits": limits}),
        public(account): jwt(operator, public(account), "tw", {"type": "account",
                                                               "limits": limits | storage}),
    }  # fmt: skip
    user_jwt = jwt(account, public(user), "tw-user", {"type": "user", **UNLIMITED})
    config = {
        "operator": jwt(operator, public(operator), "op", {"type": "operator"}),
        "system_account": public(system),
        "resolver": "MEMORY",
        "resolver_preload": accounts,
    }
    creds = (
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )
    return config, creds
