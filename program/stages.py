"""Which stages a command runs, and running them: `up`'s whole pipeline in one process (an
embedded NATS, ordered start and shutdown, the ready block) or one stage alone."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import gc
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tokenway import bus, heap, spans
from tokenway.aio import Stop
from tokenway.config import Settings
from tokenway.errors import CannotStart
from tokenway.model import tokenizer_of
from tokenway.nats_users import NatsUsers
from tokenway.natsd import EmbeddedNats
from tokenway.obfuscation import Permutation
from tokenway.served import ServedModel, obfuscation, parser_flags, parsers_said, served_models

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
    if base.render_placement == "ingress" and {"ingress", "render"} <= set(which):
        _render_beside_ingress(stages)
    return stages


def _render_beside_ingress(stages: list[Stage]) -> None:
    """The ingress hands its requests to the render stages of its process, which queue them
    for an owner over their own connections (as the render role, under `up`'s users)."""
    from ingress.service import IngressService
    from workers.render.service import RenderService

    renders = {st.model: st for st in stages if isinstance(st, RenderService)}
    for stage in stages:
        if isinstance(stage, IngressService):
            stage.render_beside.update(renders)
    log.info("the ingress renders its requests in its process (--render-placement ingress)")


def _stages(
    s: Settings, name: str, models: list[ServedModel], obf: dict[str, Permutation | None]
) -> list[Stage]:
    """The stages `name` stands for; ValueError when the settings cannot make them."""
    if name == "ingress":
        from ingress.service import IngressService

        return [IngressService(s, models)]
    if name == "render":
        from workers.derender.backend import LocalBackend
        from workers.render.service import RenderService

        for m in models:
            log.info(parsers_said(s, m))
        # vLLM's derender routes: tokenway's own derender core, in the render worker
        return [
            RenderService(
                s, m.info, m.name, parser_flags(s, m), functools.partial(LocalBackend, m.info.path)
            )
            for m in models
        ]
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
        from workers.dlq.mover import DlqMover

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
            natsd = EmbeddedNats(
                s.data_path / "jetstream", s.nats_port or -1, s.max_payload, config=auth
            )
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
    return [
        [st for st in stages if _DATA_ORDER.get(st.name, len(_DATA_ORDER)) == rank]
        for rank in ranks
    ]


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


def bus_tenants(s: Settings, named: Sequence[str] = (), up: bool = False) -> list[str]:
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


def run(s: Settings, stage_names: Sequence[str], announce: bool = False) -> None:
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
                print(
                    "tokenway: stopped at once, without draining (a second signal)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(130)
            log.warning(
                "stopping: open requests have %gs to finish (a second Ctrl-C or "
                "SIGTERM stops at once)",
                s.drain_timeout,
            )
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
        auth = s.data_path / "nats-auth"
        users = None if s.nats is not None else NatsUsers.prepare(auth, bus_tenants(s, up=True))
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


def provision(s: Settings) -> None:
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
