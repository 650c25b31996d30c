"""One NATS user per role: an nkey seed each, and the nats-server authorization that gives
each exactly its role's permissions (`tokenway.roles`), kept in one directory.

`tokenway nats-auth DIR` writes them for a deployment; `tokenway up` keeps its own under
`<data-dir>/nats-auth` and runs its embedded server with them. Seeds are made once (mode
0600) and kept; the authorization is written again from the role table every time, so it
follows the code it belongs to. For a cluster, `nats-auth` also writes what its routes
authenticate with (`write_routes`).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nkeys

from tokenway import bus
from tokenway.config import ENV_PREFIX, NATS_CREDENTIALS, TENANT_ENV, Settings
from tokenway.roles import roles, server_users

AUTH_FILE = "auth.conf"
ROUTES_FILE = "routes.conf"  # each cluster node's `cluster` block includes it
ROUTE_PASSWORD_FILE = "route.password"
ROUTE_USER = "tokenway-route"
# The routes of infra/nats/cluster-*.conf: three nodes on one host.
LOCAL_ROUTES = ("127.0.0.1:6222", "127.0.0.1:6223", "127.0.0.1:6224")


def _seed_path(directory: Path, role: str) -> Path:
    return directory / f"{role}.nk"


def _seed(path: Path) -> nkeys.KeyPair:
    """The role's key pair, its seed made (readable by the owner only) when missing."""
    if not path.exists():
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(seed + b"\n")
    return nkeys.from_seed(path.read_bytes().strip())


@dataclass(frozen=True)
class NatsUsers:
    directory: Path
    authorization: dict[str, object]  # the server configuration's `authorization` block
    tenants: tuple[str, ...] = ()  # each has a client role, `client-<tenant>`

    @classmethod
    def prepare(cls, directory: Path, tenants: Sequence[str] = ()) -> NatsUsers:
        """Seeds made where missing, then the authorization and each role's env file (a
        client role for each of `tenants`: `client-<tenant>`)."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        every = roles(tenants)
        keys = {r.name: _seed(_seed_path(directory, r.name)).public_key.decode() for r in every}
        users = cls(directory, {"users": server_users(keys, tenants)}, tuple(tenants))
        (directory / AUTH_FILE).write_text(
            "# nats-server authorization for tokenway, one nkey user per role; generated\n"
            "# by `tokenway nats-auth` from tokenway/roles.py. Include it in the server's\n"
            "# configuration: `include auth.conf` at the top level.\n"
            f"authorization: {json.dumps(users.authorization, indent=2)}\n"
        )
        users.write_env()
        return users

    def write_env(self, url: str | None = None) -> None:
        """Each role's `<role>.env`: what makes a process that loads it connect as the role
        (to `url`, where given: `up` adds its server's once it listens), a client role's
        tenant included (`tokenway.client.Client.from_env`)."""
        for role in roles(self.tenants):
            env = {**({"nats": url} if url else {}), **self.env(role.name)}
            lines = "".join(f"{ENV_PREFIX}{k.upper()}={v}\n" for k, v in env.items())
            if role.tenant:
                lines += f"{TENANT_ENV}={role.tenant}\n"
            (self.directory / f"{role.name}.env").write_text(f"# {role.name}: {role.does}\n{lines}")

    def _role(self, role: str) -> dict[str, object]:
        """The settings that make a process connect as `role`."""
        return {
            "nats_nkey_file": str(_seed_path(self.directory, role).resolve()),
            "nats_inbox_prefix": bus.inbox_prefix(role),
            "provision": role == "provision",
        }

    def env(self, role: str) -> dict[str, str]:
        """The same as environment variables' values."""
        return {
            k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in self._role(role).items()
        }

    def settings(self, s: Settings, role: str) -> Settings:
        """`s` as a process of `role` has it: no other way to authenticate left in it (TLS
        stays, it goes with any of them)."""
        others = {n: None for n in NATS_CREDENTIALS if not n.startswith("nats_tls_")}
        return msgspec.structs.replace(s, **{**others, **self._role(role)})


def _private(path: Path, text: str) -> None:
    """`text` in `path`, readable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def write_routes(directory: Path, routes: Sequence[str] = LOCAL_ROUTES) -> Path:
    """The cluster's route authentication, for `include ./auth/routes.conf` in each node's
    `cluster` block: the user and password a node asks of a route, and the routes to every
    node (`routes`: HOST:PORT each) with them in their URLs, since nats-server takes a
    listed route's credentials from its URL only. The password is made once (mode 0600)
    and kept, so the file can be written again for other hosts."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    kept = directory / ROUTE_PASSWORD_FILE
    if not kept.exists():
        _private(kept, secrets.token_hex(24) + "\n")
    password = kept.read_text().strip()
    urls = "".join(f"  nats-route://{ROUTE_USER}:{password}@{route}\n" for route in routes)
    path = directory / ROUTES_FILE
    user = f'  user: "{ROUTE_USER}"\n  password: "{password}"\n  timeout: 2\n'
    _private(
        path,
        "# The cluster's route user and its routes, generated by `tokenway nats-auth`: every\n"
        "# node's `cluster` block includes this file. Keep it as secret as the seeds.\n"
        f"authorization {{\n{user}}}\nroutes: [\n{urls}]\n",
    )
    return path
