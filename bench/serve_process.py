"""The real HTTP server as a subprocess (`python -m specexec serve ...`): start, wait healthy, stop.

The benchmark talks to it over HTTP only; the engine never imports the server.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT = 900.0  # seconds: imports plus loading (and page-evicting) a large target on a busy machine
POLL_SECONDS = 0.5
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # holds engine/ and server/ (repo or site-packages)
REJECTED_FLAG_MARKERS = ("unrecognized arguments", "invalid choice", "no such option")

SOURCE_FLAGS: dict[str, tuple[str, ...]] = {  # --sources name -> the serve flags that select it
    "resident": (),
    "ram": ("--offload", "--offload-source", "ram", "--resident-layers", "0"),
    "disk": ("--offload", "--offload-source", "disk", "--resident-layers", "0"),
}


class ServerFailed(RuntimeError):
    """The server exited or never became healthy."""


class FlagsRejected(ServerFailed):
    """The server's command line does not know a flag (an older server): the setting is skipped."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def split_flags(text: str) -> list[str]:
    """A flag string as a shell would split it: "--max-running 1" -> ["--max-running", "1"]."""
    return shlex.split(text)


def serve_command(target: str, draft: str, source: str, flags: list[str], port: int) -> list[str]:
    return [
        sys.executable, "-m", "specexec", "serve", "--target", target, "--draft", draft,
        *SOURCE_FLAGS[source], *flags, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]


def rejected_flags(log_tail: str) -> bool:
    """Whether a server that exited at startup refused its command line (argparse's messages)."""
    return any(marker in log_tail for marker in REJECTED_FLAG_MARKERS)


@dataclass
class ServerProcess:
    url: str
    command: list[str]
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> float:
        """Seconds until /health answered 200; raises if the process exits or time runs out."""
        begin = time.monotonic()
        while time.monotonic() - begin < timeout:
            if self.process.poll() is not None:
                tail = self.log_tail()
                error = FlagsRejected if rejected_flags(tail) else ServerFailed
                raise error(f"server exited with {self.process.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200:
                    return time.monotonic() - begin
            time.sleep(POLL_SECONDS)
        raise ServerFailed(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.process, grace_seconds=60)


def stop_process(process: subprocess.Popen, grace_seconds: float) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within grace_seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def running_server(target: str, draft: str, source: str, flags: list[str]) -> Iterator[tuple[ServerProcess, float]]:
    """A healthy server and its startup seconds; stopped on exit. Its log (a temp folder) is kept
    only when the server failed."""
    port = free_port()
    command = serve_command(target, draft, source, flags, port)
    log_path = Path(tempfile.mkdtemp(prefix="specexec-bench-serve-")) / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=PACKAGE_ROOT)
    server = ServerProcess(f"http://127.0.0.1:{port}", command, process, log_path)
    try:
        yield server, server.wait_healthy()
    except FlagsRejected:  # its message holds the whole story
        shutil.rmtree(log_path.parent, ignore_errors=True)
        raise
    finally:
        server.stop()
    shutil.rmtree(log_path.parent, ignore_errors=True)
