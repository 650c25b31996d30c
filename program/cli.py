"""The `tokenway` command: `up` runs everything in one process; each stage also runs alone."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from nats.aio.client import Client

from program import asyncapi, flags
from program.stages import bus_tenants, provision, run, up_stages
from tokenway import bus
from tokenway.config import NATS_CREDENTIALS, Settings, given, load_settings
from tokenway.credentials import connect_options
from tokenway.errors import CannotStart
from tokenway.model import default_model_dir
from tokenway.nats_users import AUTH_FILE, LOCAL_ROUTES, NatsUsers, write_routes

if TYPE_CHECKING:
    pass

log = logging.getLogger("tokenway")


def batch_parser() -> argparse.ArgumentParser:
    """`tokenway batch`: the runner stage, and the Batch API from a shell."""
    from program import batch

    top = argparse.ArgumentParser(
        prog="tokenway batch", description="The Batch API: run, submit, status, results, cancel."
    )
    top.set_defaults(command="batch")
    verbs = top.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("run", help="run the batch runner: batches, line by line")
    flags.common(run)
    run.add_argument(
        "--batch-concurrency", type=int, help="lines in flight at once, over all its batches (256)"
    )
    run.add_argument(
        "--batch-lease",
        type=float,
        help="seconds a batch stays held unrenewed before another runner takes it (30)",
    )

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", help="NATS server URL (required)")
        flags.nats_credentials(p)

    batch.add_verbs(verbs, common)
    return top


def dlq_parser() -> argparse.ArgumentParser:
    """`tokenway dlq`: a parser of its own, because its flags are arguments, not settings."""
    dlq = argparse.ArgumentParser(
        prog="tokenway dlq", description="Dead letters (TW_DLQ): list, show, replay, purge."
    )
    dlq.set_defaults(command="dlq")
    verbs = dlq.add_subparsers(dest="verb", required=True)
    move = verbs.add_parser("move", help="run the mover: exhausted deliveries → TW_DLQ")
    flags.common(move)

    def verb(name: str, text: str, filters: bool = False) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=text)
        p.add_argument("--nats", help="NATS server URL (required)")
        flags.nats_credentials(p)
        p.add_argument(
            "--json",
            action="store_true",
            help="print JSON lines: one object per line (per letter for ls), not an "
            "array, so a script can read them as they come",
        )
        if filters:
            p.add_argument("--stage", help="only this stage's letters (render, schedule, ...)")
            p.add_argument("--since", help="since a duration ago (30m, 2h) or an ISO time")
            p.add_argument(
                "--reason",
                help="only letters whose reason contains this text "
                "(each starts with decode: or exhausted:)",
            )
        return p

    verb("ls", "list dead letters (ID: the letter's TW_DLQ sequence)", filters=True)
    verb("show", "one dead letter with headers and payload").add_argument("id", type=int)
    replay = verb("replay", "republish to the original subject (once)", filters=True)
    replay.add_argument("ids", type=int, nargs="*", metavar="ID")
    replay.add_argument("--all", action="store_true", help="every matching letter not replayed")
    purge = verb("purge", "delete dead letters")
    purge.add_argument("--stage", help="only this stage's letters")
    purge.add_argument("--yes", action="store_true", help="do not ask")
    return dlq


async def _command_connection(settings: Settings, name: str) -> Client:
    """A command's one connection to `--nats`; a failure is one line, not a traceback."""
    import nats

    errors: list[Exception] = []  # reported once below, not as a client traceback

    async def noted(exc: Exception) -> None:
        errors.append(exc)

    url = settings.nats or ""
    try:
        options = connect_options(settings)
    except CannotStart as exc:
        raise SystemExit(f"tokenway: {exc}") from None
    try:
        # Each server tried once (nats-py's 0 here is "for ever", even without reconnects).
        async with asyncio.timeout(settings.connect_timeout):
            nc = await nats.connect(
                servers=bus.seeds(url),
                name=name,
                allow_reconnect=False,
                connect_timeout=3,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.2,
                error_cb=noted,
                **options,
            )
            await bus.try_inboxes(nc)  # denied (another role's seed): said by now
        if not errors:
            return nc
        await nc.close()
        raise errors[-1]
    except Exception as exc:
        cause = errors[-1] if errors else exc
        raise SystemExit(
            f"tokenway: cannot connect to NATS at {bus.redacted(url)}: {bus.reason(cause)}"
        ) from exc


async def _status(args: argparse.Namespace, settings: Settings) -> None:
    from program.status import format_status, read_status

    nc = await _command_connection(settings, "tokenway-status")
    try:
        status = await read_status(nc, settings)
    finally:
        await nc.close()
    print(msgspec.json.encode(status).decode() if args.json else format_status(status))


async def _batch(args: argparse.Namespace, settings: Settings) -> int:
    from program import batch

    nc = await _command_connection(settings, "tokenway-batch")
    try:
        return await batch.command(args, settings, nc)
    finally:
        await nc.close()


async def _dlq(args: argparse.Namespace, settings: Settings) -> int:
    """`tokenway dlq <verb>`: the operations live in `program.dlq`; this parses and prints."""
    from nats.js.errors import NotFoundError

    from program import dlq

    url = settings.nats or ""
    nc = await _command_connection(settings, "tokenway-dlq")
    try:
        js = nc.jetstream()
        try:
            await js.stream_info(bus.DLQ_STREAM)
        except NotFoundError:
            raise SystemExit(
                f"tokenway: no {bus.DLQ_STREAM} stream at {bus.redacted(url)}"
            ) from None
        since = None
        if getattr(args, "since", None):
            try:
                since = dlq.parse_since(args.since, time.time())
            except ValueError as exc:
                raise SystemExit(f"tokenway: {exc}") from None
        if args.verb == "ls":
            letters = await dlq.list_letters(js, args.stage, since, args.reason)
            for line in map(dlq.to_json, letters) if args.json else [dlq.format_table(letters)]:
                print(line)
        elif args.verb == "show":
            try:
                letter = await dlq.get_letter(js, args.id)
            except dlq.LetterNotFound as exc:
                raise SystemExit(f"tokenway: {exc}") from None
            print(dlq.to_json(letter, full=True) if args.json else dlq.format_letter(letter))
        elif args.verb == "replay":
            if bool(args.ids) == args.all:
                raise SystemExit("tokenway: dlq replay takes letter ids or --all")
            ids = args.ids
            if args.all:
                letters = await dlq.list_letters(js, args.stage, since, args.reason)
                ids = [x.id for x in letters if x.replayed is None]
            results = await dlq.replay(js, ids)
            for r in results:
                status = "replayed" if r.ok else "refused"
                entry = {"id": r.id, "ok": r.ok, "detail": r.detail}
                print(json.dumps(entry) if args.json else f"{status} {r.id}: {r.detail}")
            return 0 if all(r.ok for r in results) else 1
        elif args.verb == "purge":
            count = await dlq.count_letters(js, args.stage)
            what = f"{count} dead letters" + (f" of stage {args.stage}" if args.stage else "")
            ask = f"purge {what}? [y/N] "
            confirmed = args.yes or (
                sys.stdin.isatty() and await asyncio.to_thread(input, ask) == "y"
            )
            if not confirmed:
                raise SystemExit(f"tokenway: not purging {what} without --yes")
            purged = await dlq.purge(js, args.stage)
            print(json.dumps({"purged": purged}) if args.json else f"purged {purged} dead letters")
        return 0
    finally:
        await nc.close()


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="tokenway",
        description="OpenAI-compatible serving front for token-in/token-out engines, "
        "over NATS JetStream.",
    )
    root.add_argument("--version", action="version", version=f"tokenway {version('tokenway')}")
    sub = root.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="run every stage, an embedded NATS and the engines (simulated, or "
        "--vllm-url) in one process",
    )
    up.add_argument(
        "--nats-port",
        type=int,
        help="port of the embedded nats-server, on 127.0.0.1 (default 0: a free one)",
    )
    for add in (
        flags.common,
        flags.http,
        flags.parsers,
        flags.render,
        flags.limits,
        flags.derender,
        flags.scheduling,
    ):
        add(up)
    for add in (flags.sim, flags.vllm, flags.obfuscation):
        add(up)
    flags.render_placement(up, "ingress")
    for name, text in [
        ("ingress", "the OpenAI HTTP API"),
        ("render", "chat template + tokenization workers"),
        ("schedule", "request owners: flow control, dispatch, derender, commit"),
        ("derender", "token IDs → OpenAI chunks for --derender-placement pool (request-reply)"),
    ]:
        p = sub.add_parser(name, help=f"run {text} against a shared NATS server")
        flags.common(p)
        if name == "ingress":
            flags.http(p)
            flags.render_placement(p, "pool")
        if name in ("ingress", "render"):
            flags.limits(p)
        if name in ("ingress", "render", "derender"):  # an ingress may render beside itself
            flags.parsers(p)
        if name in ("ingress", "render"):
            flags.render(p)
        if name in ("ingress", "render", "schedule", "derender"):
            flags.derender(p)
        if name == "schedule":
            flags.scheduling(p)
            flags.obfuscation(p)
    engine = sub.add_parser("engine", help="run an engine bridge")
    kinds = engine.add_subparsers(dest="kind", required=True)
    sim = kinds.add_parser("sim", help="simulated engines (real token IDs, no GPU)")
    for add in (flags.common, flags.sim, flags.obfuscation):
        add(sim)
    vllm = kinds.add_parser(
        "vllm", help="bridge to vLLM token-only servers (vllm serve ... --enable-scale-out)"
    )
    for add in (flags.common, flags.vllm, flags.obfuscation):
        add(vllm)
    # Listed for --help only: main() hands `dlq ...` to dlq_parser(), `batch ...` to
    # batch_parser().
    sub.add_parser("dlq", add_help=False, help="dead letters: ls, show, replay, purge, move")
    sub.add_parser(
        "batch", add_help=False, help="the Batch API: run (the runner), submit, status, results"
    )
    prov = sub.add_parser(
        "provision", help="create or update the streams and the engine registry, then exit"
    )
    flags.common(prov)
    flags.scheduling(prov)
    status = sub.add_parser(
        "status", help="engines, queues, owned requests, dead letters and streams, from NATS"
    )
    status.add_argument("--nats", help="NATS server URL (required)")
    flags.nats_credentials(status)
    status.add_argument("--json", action="store_true", help="one JSON object")
    auth = sub.add_parser(
        "nats-auth",
        help="write one NATS user per role (nkey seeds, env files) and the nats-server "
        "authorization that gives each exactly its permissions",
    )
    auth.add_argument("dir", help="where to write them (seeds are kept if present)")
    auth.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant whose batch and RL jobs publish to the bus: a client-TENANT user that "
        "queues and reads that tenant's requests only (repeatable)",
    )
    auth.add_argument("--api-key-file", help="a client user for each tenant the key file names")
    auth.add_argument(
        "--route",
        action="append",
        metavar="HOST:PORT",
        help="a cluster node's route address, for routes.conf (repeatable; default: the three "
        "nodes of infra/nats/cluster-*.conf on 127.0.0.1:6222-6224)",
    )
    md = sub.add_parser("model-dir", help="print the bundled model directory (materializing it)")
    md.add_argument("--data-dir", help="state directory")
    sub.add_parser(
        "asyncapi",
        help="print the bus's contract for direct publishers: an AsyncAPI 3.0 document (JSON)",
    )
    return root


# Secrets a flag may carry, and the ways to give them that other users cannot read: every
# local user reads a process's arguments (`ps`, /proc/PID/cmdline) for as long as it runs.
_SECRET_FLAGS = {
    "api_key": "TOKENWAY_API_KEY or --api-key-file",
    "obfuscation_key": "TOKENWAY_OBFUSCATION_KEY or --obfuscation-key-file",
    "nats_password": "TOKENWAY_NATS_PASSWORD or --nats-password-file",
    "nats_token": "TOKENWAY_NATS_TOKEN or --nats-token-file",
    "nats": "TOKENWAY_NATS, or --nats-user with --nats-password-file",  # `user:pass@` in it
}


def _warn_secret_flags(flags: dict[str, object]) -> None:
    """One line on stderr per secret given as a flag, naming the safe ways to give it."""
    for name, safe in _SECRET_FLAGS.items():
        value = flags.get(name)
        if not value or (name == "nats" and bus.redacted(str(value)) == value):
            continue  # not given, or a `--nats` URL without credentials
        flag = "--" + name.replace("_", "-")
        print(
            f"tokenway: warning: {flag} on the command line is readable by every local user "
            f"(ps, /proc/PID/cmdline); use {safe}",
            file=sys.stderr,
            flush=True,
        )


def _role(args: argparse.Namespace) -> str | None:
    """The role (`tokenway.roles`) of the process a command starts; None for `up`, whose
    stages each connect as theirs, and for the commands that do not connect."""
    verb = getattr(args, "verb", None)
    if args.command in ("up", "model-dir", "asyncapi", "nats-auth"):
        return None
    if args.command == "dlq":
        return "dlq" if verb == "move" else "ops"
    return {"engine": "engine", "status": "ops"}.get(args.command, args.command)


def _as_role(s: Settings, role: str, flags: dict[str, object]) -> Settings:
    """A process of one role: what the operator left unset follows from the role, as the
    role's `.env` of `tokenway nats-auth` sets it (its own inboxes; where it authenticates,
    provisioning only as the provision role, the only one that may), so a role's seed is
    all a stage needs beside `--nats`. An explicit setting wins."""
    changes: dict[str, object] = {}
    if s.nats_inbox_prefix is None:
        changes["nats_inbox_prefix"] = bus.inbox_prefix(role)
    authenticates = any(
        getattr(s, n) is not None for n in NATS_CREDENTIALS if not n.startswith("nats_tls_")
    )
    if authenticates and not given("provision", flags):
        changes["provision"] = role == "provision"
    return msgspec.structs.replace(s, **changes)


def main(argv: Sequence[str] | None = None) -> None:
    # We only use transformers' tokenizers; its "PyTorch was not found" advice is noise here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {"dlq": dlq_parser, "batch": batch_parser}.get(argv[0] if argv else "")
    args = own().parse_args(argv[1:]) if own else parser().parse_args(argv)
    flags = {k.replace("-", "_"): v for k, v in vars(args).items()}
    for name in ("vllm_url", "api_key", "allowed_origins", "models"):  # repeatable: one setting
        if isinstance(flags.get(name), list):
            flags[name] = ",".join(flags[name])
    _warn_secret_flags(flags)
    settings = load_settings(flags)
    if (role := _role(args)) is not None:
        settings = _as_role(settings, role, flags)
    if args.command == "up" and not given("render_placement", flags):
        settings = msgspec.structs.replace(settings, render_placement="ingress")
    if args.command == "model-dir":
        print(default_model_dir(settings.data_path))
        return
    if args.command == "asyncapi":
        print(json.dumps(asyncapi.document(), indent=2))
        return
    if args.command == "nats-auth":
        try:
            named = bus_tenants(settings, args.tenant)
        except CannotStart as exc:
            raise SystemExit(f"tokenway: {exc}") from None
        users = NatsUsers.prepare(Path(args.dir).expanduser(), named)
        print(f"wrote {users.directory / AUTH_FILE} (include it in the nats-server configuration)")
        print(
            f"and per role a seed (<role>.nk, mode 0600) and the settings to use it "
            f"(<role>.env) in {users.directory}"
        )
        routes = write_routes(users.directory, args.route or LOCAL_ROUTES)
        print(
            f"and {routes}: the route user and routes a cluster node's `cluster` block "
            "includes (mode 0600)"
        )
        return
    if args.command == "dlq":
        if not settings.nats:
            raise SystemExit("tokenway: dlq commands need --nats URL (or TOKENWAY_NATS)")
        if args.verb == "move":
            run(settings, ["dlq"])
        else:
            raise SystemExit(asyncio.run(_dlq(args, settings)))
        return
    if args.command != "up" and not settings.nats:
        raise SystemExit(
            f"tokenway {args.command}: no NATS server to join; pass --nats nats://host:4222 "
            "(or set TOKENWAY_NATS), or run `tokenway up`, which embeds one"
        )
    if args.command == "batch":
        if args.verb == "run":
            run(settings, ["batch"])
        else:
            raise SystemExit(asyncio.run(_batch(args, settings)))
        return
    if args.command == "status":
        asyncio.run(_status(args, settings))
    elif args.command == "provision":
        provision(settings)
    elif args.command == "up":
        run(settings, up_stages(settings), announce=True)
    elif args.command == "engine":
        run(settings, [args.kind])
    elif args.command == "ingress" and settings.render_placement == "ingress":
        run(settings, ["ingress", "render"])
    else:
        run(settings, [args.command])


if __name__ == "__main__":
    main(sys.argv[1:])
