"""Run ``deepinfer serve`` as a child process on a free loopback port (tests, benchmarks, notebooks).

``with ServerProcess("--model", "tiny") as srv: openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-")``
starts the server, waits for ``/health``, and stops it by its pid (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (comments dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class ServerProcess:
    def __init__(
        self,
        *args: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 240.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args, self.host, self.port = list(args), host, port or free_port(host)
        self.startup_timeout = startup_timeout
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="deepinfer-serve-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "deepinfer_core",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})}
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.startup_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"deepinfer serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"deepinfer serve did not answer /health in {self.startup_timeout} s:\n{self.output()}"
        )

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics"))

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()  # by pid: SIGTERM, uvicorn shuts the app (and the engine) down
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        os.unlink(self.log.name)
