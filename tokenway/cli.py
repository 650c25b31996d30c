"""The `tokenway` command: `up` runs everything in one process; each stage also runs alone."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import gc
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
from nats.aio.client import Client

from tokenway import asyncapi, bus, heap, spans
from tokenway.aio import Stop
from tokenway.config import NATS_CREDENTIALS, Settings, given, load_settings
from tokenway.credentials import connect_options
from tokenway.errors import CannotStart
from tokenway.model import default_model_dir, tokenizer_of
from tokenway.nats_users import AUTH_FILE, LOCAL_ROUTES, NatsUsers, write_routes
from tokenway.natsd import EmbeddedNats
from tokenway.obfuscation import Permutation
from tokenway.served import ServedModel, obfuscation, parser_flags, served_models

if TYPE_CHECKING:
    from engines.bridge import Bridge

log = logging.getLogger("tokenway")


class Stage(Protocol):
    name: str
    started: asyncio.Event  # it does its work: what `up`'s ready block waits for

    async def run(self, nats_url: str, stop: asyncio.Event) -> None: ...


def build_stages(
    base: Settings, which: Sequence[str], users: NatsUsers | None = None
) -> list[Stage]:
    """Stages by name, one per served model where a stage serves one (render, schedule,
    derender, engines); imported here so a single-stage process loads only what it runs.
    With `users`, each stage connects to NATS as its own role."""
    models = served_models(base)
    # One permutation per model for every stage of this process that maps IDs.
    maps = {"schedule", "sim", "vllm"} & set(which)
    obf = {m.name: obfuscation(base, m.info) if maps else None for m in models}
    stages: list[Stage] = []
    for name in which:
        role = "engine" if name in ("sim", "vllm") else name
        s = base if users is None else users.settings(base, role)
        try:
            stages.extend(_stages(s, name, models, obf))
        except ValueError as exc:
            raise SystemExit(f"tokenway: {exc}") from exc
    return stages


def _stages(
    s: Settings, name: str, models: list[ServedModel], obf: dict[str, Permutation | None]
) -> list[Stage]:
    """The stages `name` stands for; ValueError when the settings cannot make them."""
    if name == "ingress":
        from ingress.service import IngressService

        return [IngressService(s, models)]
    if name == "render":
        from workers.render.service import RenderService

        return [RenderService(s, m.info, m.name, parser_flags(s, m)) for m in models]
    if name == "schedule":
        from workers.derender.backend import derender_backend
        from workers.schedule.service import ScheduleService

        # Derendering in each owner's process (the default placement): the backend is built
        # here, so one refused (a ValueError) refuses the stage before it starts.
        beside = s.derender_placement == "owner"
        return [
            ScheduleService(
                s, m.name, m.info, obf[m.name], derender_backend(s, m.info.path) if beside else None
            )
            for m in models
        ]
    if name == "derender":
        from workers.derender.service import DerenderService

        for m in models:
            parser_flags(s, m)  # refuse unknown parser names here too
        return [DerenderService(s, m.info.path, m.name) for m in models]
    if name == "sim":
        return [bridge for m in models for bridge in sim_engines(s, m, obf[m.name])]
    if name == "vllm":
        from engines.bridge import Bridge
        from engines.vllm_http import vllm_engines

        engines = vllm_engines(s, [m.name for m in models])
        return [Bridge(s, engine, obf[engine.info().model]) for engine in engines]
    if name == "dlq":
        from tokenway.dlq import DlqMover

        return [DlqMover(s)]
    if name == "batch":
        from workers.batch.service import BatchRunner

        return [BatchRunner(s, models[0].name)]  # a line naming no model gets the first
    raise ValueError(f"no stage {name!r}")


def sim_engines(s: Settings, model: ServedModel, obf: Permutation | None) -> list[Stage]:
    import secrets

    from engines.bridge import Bridge
    from engines.sim import SimConfig, SimEngine

    tokenizer = tokenizer_of(model.info.path)
    prefix = f"sim-{secrets.token_hex(3)}"
    bridges: list[Stage] = []
    roles = [r.strip() for r in s.sim_roles.split(",") if r.strip()]
    if bad := [r for r in roles if r not in ("union", "prefill", "decode")]:
        raise SystemExit(f"tokenway: unknown --sim-roles {bad}; roles are union, prefill, decode")
    for i in range(max(1 if s.sim_engines is None else s.sim_engines, len(roles))):
        config = SimConfig(
            role=roles[i] if i < len(roles) else "union",  # type: ignore[arg-type]
            id=f"{prefix}-{i}",
            model=model.name,
            eos_token_id=model.info.eos_token_ids[0],
            max_seqs=s.sim_max_seqs,
            chunk_size=s.sim_chunk_size,
            ttft=s.sim_ttft,
            itl=s.sim_itl,
            output_len=s.sim_output_len,
            tool_calls=s.sim_tool_calls,
            kv_block_size=s.kv_block_size,
        )
        # With a key, the simulated model is one trained on the permuted vocabulary.
        bridges.append(Bridge(s, SimEngine(config, tokenizer, trained_on=obf), obf))
    return bridges


def up_stages(s: Settings) -> list[str]:
    """What `up` runs: every stage, and simulated engines unless real ones are named."""
    if s.vllm_url and s.sim_engines:
        raise SystemExit(
            "tokenway: --vllm-url serves real engines; --sim-engines would mix simulated "
            "answers into theirs (leave it out, or run `tokenway engine sim` on its own)"
        )
    pool = ["derender"] if s.derender_placement == "pool" else []
    engines = ["vllm"] if s.vllm_url else []
    if not s.vllm_url and s.sim_engines != 0:
        engines.append("sim")
    return ["ingress", "render", "schedule", *pool, "dlq", "batch", *engines]


async def serve(
    s: Settings,
    stages: list[Stage],
    stop: asyncio.Event,
    announce: bool = False,
    users: NatsUsers | None = None,
) -> None:
    """Start NATS (embedded unless `--nats`; with `users`, it lets in those users only),
    provision the bus (or check it), run stages until `stop`."""
    url = s.nats
    with contextlib.ExitStack() as held:
        if url is None:
            held.enter_context(data_dir_lock(s.data_path))
            auth = {"authorization": users.authorization} if users is not None else None
            natsd = EmbeddedNats(s.data_path / "jetstream", s.nats_port or -1, s.max_payload,
                                 config=auth)  # fmt: skip
            held.callback(natsd.stop)
            try:
                url = await natsd.start()
            except (RuntimeError, TimeoutError) as exc:
                raise CannotStart(f"the embedded nats-server did not start: {exc}") from None
            if users is not None:  # a process that loads a role's env file finds the server
                users.write_env(url)
        provisioner = s if users is None else users.settings(s, "provision")
        # Named for who connects: the provision role, or the one stage run alone.
        kinds = {stage.name for stage in stages}
        who = f"{kinds.pop()}-streams" if users is None and len(kinds) == 1 else "provision"
        denied: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def noted(exc: Exception) -> None:  # a role told to do what it may not
            if bus.violation(exc) and not denied.done():
                denied.set_result(exc)

        nc = await bus.connect(url, f"tokenway-{who}", provisioner, stop=stop, noted=noted)
        ready: Awaitable[object]
        if provisioner.provision:
            ready = bus.provision_streams(nc.jetstream(), s)
        else:
            ready = bus.wait_for_streams(nc.jetstream(), s, stop)
        await bus.unless_denied(nc, url, ready, denied)
        await nc.close()
        async with asyncio.TaskGroup() as group:
            tiers = []
            for tier in _in_data_order(stages):
                tier_stop = Stop()
                runs = [group.create_task(t.run(url, tier_stop), name=t.name) for t in tier]
                tiers.append((tier_stop, runs))
            if tiers:  # (no stages: nothing to run, nothing to stop)
                group.create_task(_stop_in_order(stop, s.drain_timeout, tiers))
            if announce:
                group.create_task(_announce(stages, url, users))


# Stages stop in the order the data flows: what takes requests in first, each next one
# once those before it are done (their requests in flight still go through it), the engines
# last; a stage not named here stops with the engines.
_DATA_ORDER = {"ingress": 0, "batch": 0, "render": 1, "schedule": 2}


def _in_data_order(stages: Sequence[Stage]) -> list[list[Stage]]:
    ranks = sorted({_DATA_ORDER.get(stage.name, len(_DATA_ORDER)) for stage in stages})
    return [[st for st in stages if _DATA_ORDER.get(st.name, len(_DATA_ORDER)) == rank]
            for rank in ranks]  # fmt: skip


async def _stop_in_order(
    stop: asyncio.Event, within: float, tiers: list[tuple[Stop, list[asyncio.Task[None]]]]
) -> None:
    """Once `stop` is set, stop each tier of stages after the one before it has ended, all
    within one grace of `within` seconds (a later tier drains for what is left of it)."""
    await stop.wait()
    until = asyncio.get_running_loop().time() + within
    for tier_stop, runs in tiers:
        tier_stop.until = until
        tier_stop.set()
        await asyncio.wait(runs)


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Holds `<data_dir>/tokenway.lock` while an embedded nats-server uses the directory's
    JetStream store: a second server on the same store would corrupt it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "tokenway.lock"
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise CannotStart(
                f"{data_dir} is in use by {holder}; give this one its own --data-dir, "
                "or point it at the running NATS with --nats"
            ) from None
        lock.truncate(0)
        lock.write(f"tokenway up (pid {os.getpid()})\n")
        lock.flush()
        yield


def _tenants(s: Settings, named: Sequence[str] = (), up: bool = False) -> list[str]:
    """The tenants that get a client user on the bus: the API keys' and those named; under
    `up` without keys, `default` (so a job on the bus has a user to run as)."""
    from ingress.auth import DEFAULT_TENANT, tenants

    try:
        found = tenants(s.api_key, s.api_key_file, named)
    except ValueError as exc:
        raise CannotStart(str(exc)) from None
    return found or ([DEFAULT_TENANT] if up else [])


async def _announce(stages: list[Stage], nats_url: str, users: NatsUsers | None) -> None:
    """Once the API listens: where everything is, in one block."""
    from engines.bridge import Bridge
    from ingress.service import IngressService

    nats = bus.redacted(nats_url)
    jobs = ""
    if users is not None:
        nats += f"  (its users in {users.directory})"
        envs = " ".join(str(users.directory / f"client-{t}.env") for t in users.tenants)
        jobs = f"\n  jobs     batch/RL jobs on the bus load {envs} (README: Publishing directly)"
    ingress = next(stage for stage in stages if isinstance(stage, IngressService))
    for stage in stages:  # the block comes after every stage's line of the log
        await stage.started.wait()
    bridges = [stage for stage in stages if isinstance(stage, Bridge)]
    if bridges:
        log.info("waiting for the first health check of %d engine(s)", len(bridges))
    for bridge in bridges:
        await bridge.checked.wait()
    engines = ", ".join(_engine_line(b) for b in bridges) or "none in this process"
    print(
        f"tokenway serving the OpenAI API at {ingress.url}/v1\n"
        f"  models   {', '.join(m.name for m in ingress.models)}\n"
        f"  engines  {engines}\n"
        f"  NATS     {nats}{jobs}\n"
        f"  metrics  {ingress.url}/metrics",
        flush=True,
    )


def _engine_line(bridge: Bridge) -> str:
    info = bridge.engine.info()
    health = "healthy" if bridge.problem is None else f"not healthy yet: {bridge.problem}"
    return f"{info.id} ({info.role}, {info.model}, {health})"


def _open_files() -> None:
    """As many open files as the system allows this process: every client connection, NATS
    connection and engine stream is one, and systemd's soft limit of 1024 ran out near a
    thousand clients, before `--max-connections-per-address` could act."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        log.warning("open files stay at %d (the hard limit is %s): %s", soft, hard, exc)


def _run(s: Settings, stage_names: Sequence[str], announce: bool = False) -> None:
    logging.basicConfig(
        level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _open_files()
    heap.map_big_blocks()

    stopping = threading.Event()  # outlives the loop: a stop is no failure to report

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stopping.is_set():  # a second signal: no more draining, and no tracebacks of
                # requests cut short; an embedded nats-server stops too (told as we exit)
                print("tokenway: stopped at once, without draining (a second signal)",
                      file=sys.stderr, flush=True)  # fmt: skip
                os._exit(130)
            log.warning("stopping: open requests have %gs to finish (a second Ctrl-C or "
                        "SIGTERM stops at once)", s.drain_timeout)  # fmt: skip
            stopping.set()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        if s.metrics_port is not None:
            serve_metrics(s.metrics_host, s.metrics_port)
        if s.otlp_endpoint:
            try:
                spans.configure(s.otlp_endpoint)
            except ValueError as exc:
                raise CannotStart(str(exc)) from None
        # An embedded server lets in its own users only, one per role, and a client of each
        # tenant the API keys name for its jobs on the bus (of `default` without keys).
        users = None if s.nats is not None else NatsUsers.prepare(s.data_path / "nats-auth",
                                                                  _tenants(s, up=True))  # fmt: skip
        stages = build_stages(s, stage_names, users)
        # What start-up made (modules, tokenizers, templates) lives as long as the process.
        # Frozen out of the collector's reach, it is no longer walked by full collections,
        # which took a stage 33-155 ms each (an owner paused stalls all its streams).
        gc.collect()
        gc.freeze()
        await serve(s, stages, stop, announce, users)

    try:
        _run_loop(main())
    except* CannotStart as group:
        if not stopping.is_set():
            raise SystemExit(f"tokenway: {group.exceptions[0]}") from None
    finally:
        spans.shutdown()  # the spans still batched go out before the process does


def _provision(s: Settings) -> None:
    """`tokenway provision`: every stream and bucket made or brought to the settings, each
    one's outcome on a line of stdout, then a line of summary; a refusal (replicas it would
    lower) is one line on stderr and status 1."""
    logging.basicConfig(
        level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def main() -> list[bus.Provisioned]:
        nc = await bus.connect(s.nats or "", "tokenway-provision", s)
        try:
            return await bus.provision_streams(nc.jetstream(), s)
        finally:
            await nc.close()

    try:
        done = asyncio.run(main())
    except CannotStart as exc:
        raise SystemExit(f"tokenway: {exc}") from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    for p in done:
        print(p.line())
    print(f"{bus.provisioned_summary(done)} at {bus.redacted(s.nats or '')}", flush=True)


def serve_metrics(host: str, port: int) -> None:
    """The process's registry (every stage's metrics, an ingress's too: the page its API's
    /metrics serves) on a thread of its own."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise CannotStart(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    log.info("metrics at http://%s:%d/metrics", host, port)


def _run_loop(main: Coroutine[None, None, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


# -- argument parsing ------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common")
    g.add_argument(
        "--nats",
        help="NATS server URL, or a comma-separated seed list of a cluster's servers "
        "(TOKENWAY_NATS); `up` without it embeds a nats-server, other stages need it",
    )
    g.add_argument(
        "--drain-timeout", type=float,
        help="seconds open streams and owned requests get to finish on SIGTERM/SIGINT (20)",
    )  # fmt: skip
    g.add_argument(
        "--provision", action=argparse.BooleanOptionalAction,
        help="create or update the streams at start (default); --no-provision waits until "
        "they exist, as `tokenway provision` makes them (a least-privilege role may not touch "
        "them)",
    )  # fmt: skip
    g.add_argument(
        "--replicas", type=int,
        help="replicas of each stream and bucket it creates, or raises (TOKENWAY_REPLICAS; "
        "default 0: the cluster's servers up to 3, 1 on a lone server); provision never lowers "
        "a stream's replicas, it refuses",
    )  # fmt: skip
    g.add_argument(
        "--connect-timeout",
        type=float,
        help="seconds to keep trying to reach NATS at start before exiting with status 1 (30)",
    )
    _nats_credentials(p)
    g.add_argument("--data-dir", help="state directory (JetStream store, model dir)")
    g.add_argument(
        "--model-dir",
        help="a local Hugging Face model directory (default: bundled DeepSeek-V4 tokenizer)",
    )
    g.add_argument("--served-model-name", help="the model name clients use")
    g.add_argument(
        "--model", action="append", dest="models", metavar="NAME[=DIR]",
        help="serve a model under NAME, from a local Hugging Face directory (without DIR: the "
        "bundled tokenizer); repeatable, in place of --model-dir and --served-model-name",
    )  # fmt: skip
    g.add_argument("--max-model-len", type=int, help="cap the context length, in tokens")
    g.add_argument(
        "--context-budget",
        choices=["on", "off"],
        help="on: clip a max_tokens that does not fit the context (default off: a 400)",
    )
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--otlp-endpoint",
        help="send each stage's spans of a request to this OTLP/HTTP collector, e.g. "
        "http://127.0.0.1:4318 (needs the otel extra; default: no spans)",
    )
    g.add_argument(
        "--metrics-port", type=int,
        help="serve this process's metrics at http://HOST:PORT/metrics (default: none); an "
        "ingress's API /metrics is the same page",
    )  # fmt: skip
    g.add_argument(
        "--metrics-host",
        help="where --metrics-port listens (default 127.0.0.1; 0.0.0.0 in a container, for "
        "the scraper)",
    )
    g.add_argument(
        "--engine-ttl", type=float, help="seconds an engine stays registered without a beat (5)"
    )
    g.add_argument(
        "--request-timeout", type=float, help="default deadline of a request, seconds (600)"
    )


def _nats_credentials(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "NATS credentials (one way; each flag also reads TOKENWAY_<FLAG>; prefer the files)"
    )
    g.add_argument("--nats-user", help="user name, with a password")
    g.add_argument("--nats-password", help="password (prefer --nats-password-file)")
    g.add_argument("--nats-password-file", help="read the password from this file")
    g.add_argument("--nats-token", help="token (prefer --nats-token-file)")
    g.add_argument("--nats-token-file", help="read the token from this file")
    g.add_argument("--nats-nkey-file", help="an nkey seed file (SU...)")
    g.add_argument("--nats-creds", help="a .creds file: user JWT and nkey seed")
    g.add_argument("--nats-tls-ca", help="CA certificate(s) to trust for the server (PEM)")
    g.add_argument("--nats-tls-cert", help="client certificate for mutual TLS (PEM)")
    g.add_argument("--nats-tls-key", help="its private key (PEM)")
    g.add_argument(
        "--nats-inbox-prefix",
        help="where this process's replies arrive (default: its role's own, _INBOX.<role>, "
        "as `tokenway nats-auth` gives each role; under `up --nats`, _INBOX)",
    )


def _scheduling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling")
    g.add_argument("--kv-block-size", type=int, help="KV block size for affinity hashes (16)")
    g.add_argument(
        "--prefill-scale", type=float, help="weight of uncached prompt blocks vs load (1.0)"
    )
    g.add_argument("--affinity-ttl", type=float, help="seconds a routed prefix counts (300)")
    g.add_argument(
        "--breaker-threshold", type=int, help="engine failures in a row that open its breaker (3)"
    )
    g.add_argument("--max-inflight", type=int, help="requests one schedule worker owns (1024)")
    g.add_argument(
        "--owner-lookahead", type=int,
        help="sequences a schedule worker pulls beyond its engines' room, so that tenants "
        "take turns in its waiting line (64; 0: pull only what fits)",
    )  # fmt: skip
    g.add_argument(
        "--batch-headroom", type=float,
        help="share of each engine's sequences and KV tokens a batch job's requests leave free "
        "for interactive ones (0.125)",
    )  # fmt: skip
    g.add_argument(
        "--batch-busy-share", type=float,
        help="share of each engine a batch job's requests may take while a schedule worker "
        "runs interactive ones, and for a second after (0.25)",
    )  # fmt: skip
    g.add_argument(
        "--decode-reserve", type=int,
        help="engine tokens a sequence holds ahead of its output, charged again as it outgrows "
        "them up to its max_tokens (1024): what flow control charges instead of max_tokens",
    )  # fmt: skip
    g.add_argument(
        "--engine-wait", type=float,
        help="seconds a request waits for an engine of its model to register before a 503 (10)",
    )  # fmt: skip
    g.add_argument(
        "--owner-ack-wait", type=float,
        help="seconds after a schedule worker's last progress ack that its requests move to "
        "another worker (2)",
    )  # fmt: skip
    g.add_argument(
        "--relay-attempts",
        type=int,
        help="times a request continues on another engine after one fails it (3)",
    )
    g.add_argument("--queue-max-msgs", type=int, help="queued requests per stage (10000)")
    g.add_argument(
        "--max-fanout", type=int, help="multi-prompt requests one schedule worker owns (64)"
    )
    g.add_argument(
        "--fanout-buffer", type=int,
        help="output events held per prompt until every prompt's stream has begun (1024)",
    )  # fmt: skip
    g.add_argument(
        "--fanout-retries", type=int,
        help="whole-request retries of a multi-prompt request failing before output (1)",
    )  # fmt: skip
    g.add_argument(
        "--share-prefix-cache", action="store_true", default=None,
        help="tenants (API keys, direct clients) share the engines' prefix caches: for tenants "
        "that trust each other (default: each tenant's prompts are salted apart, so that no "
        "tenant can time another's cached prompt)",
    )  # fmt: skip
    g.add_argument(
        "--trust-client-kv-transfer", action="store_true", default=None,
        help="pass a tenant's kv_transfer_params on to the engines, for clients that are "
        "trusted P/D coordinators (default: a 400, since they name KV blocks that may hold "
        "another tenant's prompt; without API keys they are always passed on)",
    )  # fmt: skip


def _parsers(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output parsing (as `vllm serve` names it)")
    g.add_argument(
        "--reasoning-parser",
        help="deepseek_r1, deepseek_v3 or qwen3 (bundled model: deepseek_v3)",
    )
    g.add_argument(
        "--tool-call-parser", help="deepseek_v31 or hermes (bundled model: deepseek_v31)"
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help='parse tool calls for tool_choice "auto" (bundled model: on)',
    )
    g.add_argument(
        "--strict-tool-calling", action=argparse.BooleanOptionalAction, default=None,
        help="constrain tool calls to the tool parser's own syntax with a structural tag, as "
        "vLLM does by default (on); off: a forced call to the tools' JSON schema, as vLLM "
        "with VLLM_ENFORCE_STRICT_TOOL_CALLING=0",
    )  # fmt: skip
    g.add_argument(
        "--tool-strict-level", choices=["auto", "function", "parameter"],
        help="as vLLM's: auto (default) constrains calls where tool_choice forces one or a "
        "tool is strict; function also every auto call's envelope; parameter also every "
        "tool's arguments to its schema",
    )  # fmt: skip


def _render(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("render backend")
    g.add_argument(
        "--render-backend",
        choices=["local", "vllm"],
        help="local: the model directory's tokenizer (default); vllm: a vLLM render server at "
        "--render-url, falling back to the local tokenizer when it fails",
    )
    g.add_argument("--render-url", help="http://host:port of the vLLM render server")
    g.add_argument(
        "--render-connect-timeout", type=float, help="seconds to connect to it (default 2)"
    )
    g.add_argument("--render-timeout", type=float, help="seconds for its whole reply (default 10)")


def _limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "request limits (ingress and render: past one, a 400 before anything is templated, "
        "tokenized or compiled)"
    )
    g.add_argument(
        "--max-tools", type=int,
        help="tools one request may give (1024; OpenAI takes 128)",
    )  # fmt: skip
    g.add_argument(
        "--max-schema-bytes", type=int,
        help="bytes of JSON text in all of a request's schemas together: tools' parameters, "
        "response_format, structured_outputs (1048576); checked before the body is decoded",
    )  # fmt: skip
    g.add_argument(
        "--max-schema-nodes", type=int,
        help="JSON values (objects, arrays, scalars) in all of a request's schemas together, "
        "a structural tag's too (65536)",
    )  # fmt: skip
    g.add_argument(
        "--max-grammar-bytes", type=int,
        help="bytes of a request's regexes, grammars and choices, with its schemas' patterns "
        "(65536)",
    )  # fmt: skip


def _derender(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("derender (render needs the backend too: it adds the client body)")
    g.add_argument(
        "--derender-placement",
        choices=["owner", "pool"],
        help="owner: each schedule worker derenders its own requests in process (default); "
        "pool: it calls the derender workers (`tokenway derender`) over the bus",
    )
    g.add_argument(
        "--derender-backend",
        choices=["local", "vllm"],
        help="local: the model directory's tokenizer (default); vllm: a vLLM derender server "
        "at --derender-url, with no local fallback",
    )
    g.add_argument(
        "--derender-url", help="http://host:port of it (default: --render-url, TOKENWAY_RENDER_URL)"
    )
    g.add_argument(
        "--derender-connect-timeout", type=float, help="seconds to connect to it (default 2)"
    )
    g.add_argument(
        "--derender-server-timeout",
        type=float,
        help="seconds for its whole reply (default 5; must be below TOKENWAY_DERENDER_TIMEOUT, 10)",
    )


def _http(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--ingress-id", help="this ingress's id on the bus (default: random)")
    p.add_argument(
        "--access-log", action="store_true", default=None,
        help="log a line per HTTP response on stdout (client, method, path, status)",
    )  # fmt: skip
    p.add_argument(
        "--max-request-bytes", type=int,
        help="a request body above this is refused with a 413 before it is read (8000000)",
    )  # fmt: skip
    p.add_argument(
        "--body-timeout", type=float,
        help="seconds a client has to send its whole request body; later, a 408 (30)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-rate", type=int,
        help="bytes a second of request bodies one client (tenant, or address without keys) "
        "may send; faster, its next body waits unread (33554432; 0: no bound)",
    )  # fmt: skip
    p.add_argument(
        "--header-timeout", type=float,
        help="seconds a client has to send a request's whole head (request line and headers) "
        "from its first byte, or from connecting; later, a 408 and the connection closed (10)",
    )  # fmt: skip
    p.add_argument(
        "--max-header-bytes", type=int,
        help="bytes a request's head (request line and headers) may have; past them, a 431 "
        "and the connection closed (65536)",
    )  # fmt: skip
    p.add_argument(
        "--max-connections-per-address", type=int,
        help="connections one client address may hold open at once; past them, a 429 and the "
        "connection closed (1024: room for a load generator or a proxy; 0: no cap)",
    )  # fmt: skip
    p.add_argument(
        "--stream-buffer-bytes", type=int,
        help="output bytes held for a stream whose client reads slowly; the rest is read back "
        "from TW_OUT as it catches up (1048576)",
    )  # fmt: skip
    g = p.add_argument_group("API keys (none given: the API is open)")
    g.add_argument(
        "--api-key", action="append",
        help="a key clients send as `Authorization: Bearer KEY` (repeatable; tenant "
        "`default`); prefer TOKENWAY_API_KEY (comma-separated) or --api-key-file",
    )  # fmt: skip
    g.add_argument(
        "--api-key-file",
        help="keys of several tenants, `TENANT KEY [concurrent=N] [tokens_per_minute=N] "
        "[files_bytes=N] [files_count=N] [responses_bytes=N] [responses_count=N]` per line "
        "(# comments); a tenant's limits are shared by all its keys and every ingress",
    )
    g.add_argument(
        "--tenant-concurrency", type=int,
        help="requests a tenant may run at once where its key file sets no limit (default 0: "
        "no limit); past it, a 429 with Retry-After",
    )  # fmt: skip
    g.add_argument(
        "--tenant-tokens-per-minute", type=int,
        help="tokens (prompt + max_tokens × n; no max_tokens: the context left) a tenant may "
        "start per minute where its key file sets no limit (default 0: no limit)",
    )  # fmt: skip
    g.add_argument(
        "--tenant-files-bytes", type=int,
        help="bytes of files (uploads, batch outputs) a tenant may keep where its key file "
        "sets none (1073741824, a quarter of the files store; 0: no limit); past it, a 400",
    )  # fmt: skip
    g.add_argument(
        "--tenant-files-count", type=int,
        help="files a tenant may keep, a running batch's parts among them (10000)",
    )  # fmt: skip
    g.add_argument(
        "--tenant-responses-bytes", type=int,
        help="bytes of stored responses a tenant may keep (268435456, a quarter of the "
        "store; each leaves at TOKENWAY_RESPONSES_MAX_AGE); past it, `store: true` is a 400",
    )  # fmt: skip
    g.add_argument(
        "--tenant-responses-count", type=int, help="stored responses a tenant may keep (100000)"
    )
    g.add_argument(
        "--open-routes",
        help="routes served without a key besides /health: ready, metrics, both (default) or none",
    )
    g = p.add_argument_group("CORS (no origin given: browsers get no cross-origin access)")
    g.add_argument(
        "--allowed-origins", action="append",
        help="an origin browsers may call from, `https://app.example` or `*` (repeatable; a "
        "JSON list or comma-separated also works)",
    )  # fmt: skip
    g.add_argument("--allowed-methods", help="methods they may use (default `*`)")
    g.add_argument("--allowed-headers", help="request headers they may send (default `*`)")
    g.add_argument(
        "--allow-credentials", action="store_true", default=None,
        help="let them send cookies and HTTP auth too (not with origin `*`)",
    )  # fmt: skip


def _sim(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated engine")
    g.add_argument(
        "--sim-engines", type=int,
        help="how many simulated engines per model (default 1; `up` with --vllm-url: 0, none)",
    )  # fmt: skip
    g.add_argument("--sim-max-seqs", type=int, help="concurrent sequences per engine (default 256)")
    g.add_argument("--sim-chunk-size", type=int, help="tokens per sequence per step (default 1)")
    g.add_argument("--sim-ttft", type=float, help="seconds to first token (default 0.02)")
    g.add_argument("--sim-itl", type=float, help="seconds per token (default 0.01)")
    g.add_argument("--sim-output-len", type=int, help="mean output length before EOS (default 200)")
    g.add_argument(
        "--sim-roles", help="roles of the simulated engines, e.g. prefill,decode (default union)"
    )
    g.add_argument(
        "--sim-tool-calls", action="store_true", default=None,
        help="the simulated model calls a tool where the prompt's last turn is a user's (the "
        "tool the turn names, else the first; made-up arguments of its schema) and answers a "
        "tool's output in text, so an agent client's tool loop runs (off: free text wherever "
        "it is allowed); it knows the tools only from the request's constraint, which under "
        "tool_choice auto takes --tool-strict-level function",
    )  # fmt: skip


def _vllm(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM engine")
    g.add_argument(
        "--vllm-url", action="append", metavar="[MODEL=]URL",
        help="http://host:port of a vLLM server (repeatable); MODEL= names the served model "
        "it runs where there are several",
    )  # fmt: skip
    g.add_argument("--engine-id", help="id in the registry (default: vllm-<host>-<port>)")
    g.add_argument("--engine-role", choices=["union", "prefill", "decode"], help="default union")
    g.add_argument("--engine-max-seqs", type=int, help="concurrent sequences (default 256)")
    g.add_argument("--engine-connect-timeout", type=float, help="seconds (default 5)")
    g.add_argument(
        "--engine-first-token-timeout", type=float, help="seconds to first token (default 600)"
    )
    g.add_argument("--engine-token-timeout", type=float, help="seconds between tokens (default 60)")


def _obfuscation(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "token obfuscation (the same key on every schedule and engine stage; see docs/engines.md)"
    )
    g.add_argument(
        "--obfuscation-key",
        help="secret key (16+ bytes) permuting token IDs between schedulers and engines; "
        "prefer TOKENWAY_OBFUSCATION_KEY or --obfuscation-key-file over this flag",
    )
    g.add_argument(
        "--obfuscation-key-file", help="read the key from this file (surrounding blanks dropped)"
    )


def batch_parser() -> argparse.ArgumentParser:
    """`tokenway batch`: the runner stage, and the Batch API from a shell."""
    from tokenway import batch_cli

    batch = argparse.ArgumentParser(
        prog="tokenway batch", description="The Batch API: run, submit, status, results, cancel."
    )
    batch.set_defaults(command="batch")
    verbs = batch.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("run", help="run the batch runner: batches, line by line")
    _common(run)
    run.add_argument("--batch-concurrency", type=int,
                     help="lines in flight at once, over all its batches (256)")  # fmt: skip
    run.add_argument("--batch-lease", type=float,
                     help="seconds a batch stays held unrenewed before another runner takes it "
                     "(30)")  # fmt: skip

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", help="NATS server URL (required)")
        _nats_credentials(p)

    batch_cli.add_verbs(verbs, common)
    return batch


def dlq_parser() -> argparse.ArgumentParser:
    """`tokenway dlq`: a parser of its own, because its flags are arguments, not settings."""
    dlq = argparse.ArgumentParser(
        prog="tokenway dlq", description="Dead letters (TW_DLQ): list, show, replay, purge."
    )
    dlq.set_defaults(command="dlq")
    verbs = dlq.add_subparsers(dest="verb", required=True)
    move = verbs.add_parser("move", help="run the mover: exhausted deliveries → TW_DLQ")
    _common(move)

    def verb(name: str, text: str, filters: bool = False) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=text)
        p.add_argument("--nats", help="NATS server URL (required)")
        _nats_credentials(p)
        p.add_argument("--json", action="store_true",
                       help="print JSON lines: one object per line (per letter for ls), not an "
                            "array, so a script can read them as they come")  # fmt: skip
        if filters:
            p.add_argument("--stage", help="only this stage's letters (render, schedule, ...)")
            p.add_argument("--since", help="since a duration ago (30m, 2h) or an ISO time")
            p.add_argument("--reason", help="only letters whose reason contains this text "
                           "(each starts with decode: or exhausted:)")  # fmt: skip
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
                servers=bus.seeds(url), name=name, allow_reconnect=False, connect_timeout=3,
                max_reconnect_attempts=1, reconnect_time_wait=0.2, error_cb=noted, **options,
            )  # fmt: skip
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
    from tokenway.status import format_status, read_status

    nc = await _command_connection(settings, "tokenway-status")
    try:
        status = await read_status(nc, settings)
    finally:
        await nc.close()
    print(msgspec.json.encode(status).decode() if args.json else format_status(status))


async def _batch(args: argparse.Namespace, settings: Settings) -> int:
    from tokenway import batch_cli

    nc = await _command_connection(settings, "tokenway-batch")
    try:
        return await batch_cli.command(args, settings, nc)
    finally:
        await nc.close()


async def _dlq(args: argparse.Namespace, settings: Settings) -> int:
    """`tokenway dlq <verb>`: the operations live in `tokenway.dlq`; this parses and prints."""
    from nats.js.errors import NotFoundError

    from tokenway import dlq

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
        "up", help="run every stage, an embedded NATS and the engines (simulated, or "
        "--vllm-url) in one process",
    )  # fmt: skip
    up.add_argument(
        "--nats-port", type=int,
        help="port of the embedded nats-server, on 127.0.0.1 (default 0: a free one)",
    )  # fmt: skip
    for add in (_common, _http, _parsers, _render, _limits, _derender, _scheduling):
        add(up)
    for add in (_sim, _vllm, _obfuscation):
        add(up)
    for name, text in [
        ("ingress", "the OpenAI HTTP API"),
        ("render", "chat template + tokenization workers"),
        ("schedule", "request owners: flow control, dispatch, derender, commit"),
        ("derender", "token IDs → OpenAI chunks for --derender-placement pool (request-reply)"),
    ]:
        p = sub.add_parser(name, help=f"run {text} against a shared NATS server")
        _common(p)
        if name == "ingress":
            _http(p)
        if name in ("ingress", "render"):
            _limits(p)
        if name in ("render", "derender"):
            _parsers(p)
        if name == "render":
            _render(p)
        if name in ("render", "schedule", "derender"):
            _derender(p)
        if name == "schedule":
            _scheduling(p)
            _obfuscation(p)
    engine = sub.add_parser("engine", help="run an engine bridge")
    kinds = engine.add_subparsers(dest="kind", required=True)
    sim = kinds.add_parser("sim", help="simulated engines (real token IDs, no GPU)")
    for add in (_common, _sim, _obfuscation):
        add(sim)
    vllm = kinds.add_parser(
        "vllm", help="bridge to vLLM token-only servers (vllm serve ... --enable-scale-out)"
    )
    for add in (_common, _vllm, _obfuscation):
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
    _common(prov)
    _scheduling(prov)
    status = sub.add_parser(
        "status", help="engines, queues, owned requests, dead letters and streams, from NATS"
    )
    status.add_argument("--nats", help="NATS server URL (required)")
    _nats_credentials(status)
    status.add_argument("--json", action="store_true", help="one JSON object")
    auth = sub.add_parser(
        "nats-auth",
        help="write one NATS user per role (nkey seeds, env files) and the nats-server "
        "authorization that gives each exactly its permissions",
    )
    auth.add_argument("dir", help="where to write them (seeds are kept if present)")
    auth.add_argument(
        "--tenant", action="append", default=[],
        help="a tenant whose batch and RL jobs publish to the bus: a client-TENANT user that "
        "queues and reads that tenant's requests only (repeatable)",
    )  # fmt: skip
    auth.add_argument("--api-key-file", help="a client user for each tenant the key file names")
    auth.add_argument(
        "--route", action="append", metavar="HOST:PORT",
        help="a cluster node's route address, for routes.conf (repeatable; default: the three "
        "nodes of infra/nats/cluster-*.conf on 127.0.0.1:6222-6224)",
    )  # fmt: skip
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
        print(f"tokenway: warning: {flag} on the command line is readable by every local user "
              f"(ps, /proc/PID/cmdline); use {safe}", file=sys.stderr, flush=True)  # fmt: skip


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
    authenticates = any(getattr(s, n) is not None for n in NATS_CREDENTIALS
                        if not n.startswith("nats_tls_"))  # fmt: skip
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
    if args.command == "model-dir":
        print(default_model_dir(settings.data_path))
        return
    if args.command == "asyncapi":
        print(json.dumps(asyncapi.document(), indent=2))
        return
    if args.command == "nats-auth":
        try:
            named = _tenants(settings, args.tenant)
        except CannotStart as exc:
            raise SystemExit(f"tokenway: {exc}") from None
        users = NatsUsers.prepare(Path(args.dir).expanduser(), named)
        print(f"wrote {users.directory / AUTH_FILE} (include it in the nats-server configuration)")
        print(f"and per role a seed (<role>.nk, mode 0600) and the settings to use it "
              f"(<role>.env) in {users.directory}")  # fmt: skip
        routes = write_routes(users.directory, args.route or LOCAL_ROUTES)
        print(f"and {routes}: the route user and routes a cluster node's `cluster` block "
              "includes (mode 0600)")  # fmt: skip
        return
    if args.command == "dlq":
        if not settings.nats:
            raise SystemExit("tokenway: dlq commands need --nats URL (or TOKENWAY_NATS)")
        if args.verb == "move":
            _run(settings, ["dlq"])
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
            _run(settings, ["batch"])
        else:
            raise SystemExit(asyncio.run(_batch(args, settings)))
        return
    if args.command == "status":
        asyncio.run(_status(args, settings))
    elif args.command == "provision":
        _provision(settings)
    elif args.command == "up":
        _run(settings, up_stages(settings), announce=True)
    elif args.command == "engine":
        _run(settings, [args.kind])
    else:
        _run(settings, [args.command])


if __name__ == "__main__":
    main(sys.argv[1:])
