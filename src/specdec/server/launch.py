"""Run `specdec serve` as a child process: used by the tests, and by anything (bench, examples)
that needs a live server for a while.

    with ServerProcess(["--target", "tiny-llama", "--ngram", "3"]) as server:
        httpx.get(server.url + "/health")

The child binds port 0 (the OS picks a free port, so there is no race between choosing a port
and binding it) and the port is read from its "ready on http://HOST:PORT" line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

from ..errors import SpecdecError

_READY = re.compile(r"ready on (http://\S+?):(\d+)")


class ServerProcess:
    def __init__(self, serve_args: list[str], *, host: str = "127.0.0.1", timeout: float = 180.0,
                 env: dict | None = None):
        self.serve_args = list(serve_args)
        self.host = host
        self.timeout = timeout
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.url: str | None = None  # http://host:port, no trailing slash
        self._lines: list[str] = []
        self._ready = threading.Event()

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def start(self) -> ServerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(self.env or {}))
        cmd = [sys.executable, "-m", "specdec", "serve", *self.serve_args, "--host", self.host, "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                raise SpecdecError(f"specdec serve exited with code {self.proc.returncode}:\n{self.output}")
            if time.monotonic() > deadline:
                self.stop()
                raise SpecdecError(f"specdec serve was not ready after {self.timeout:.0f} s:\n{self.output}")
        while True:  # the banner prints after bind; /health proves the app answers
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SpecdecError(f"{self.url}/health did not answer within {self.timeout:.0f} s:\n{self.output}")
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)
            m = _READY.search(line)
            if m and not self._ready.is_set():
                self.port = int(m.group(2))
                self.url = f"{m.group(1)}:{self.port}"
                self._ready.set()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
