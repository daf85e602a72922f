"""Triton Inference Server on a model repository, from the tritonserver binary the nvidia-pytriton
wheel ships (a real Triton 2.51 with the Python backend, CPU or GPU). pytriton's own Python API is
not used: it pins numpy<2, which this project's lock cannot take. The binary and its Python
backend run the model in a venv beside this one (STUB_ENV).

Every address is 127.0.0.1 unless the caller names another (Triton's own default is 0.0.0.0)."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"
INSTALL = (f"pip install --no-deps {PYTRITON} (its numpy<2 pin is for pytriton's Python API, which this does not "
           "use), or `make venv`")
# The wheel's Python backend stub is built against numpy 1: under numpy 2 it corrupts every STRING
# input (the bytes reach Python all equal to the first one) and aborts. So the model's processes
# run in a small venv of their own, STUB_ENV: numpy 1 in it, and this environment's packages after
# it (a .pth file); onnxruntime, tokenizers and Pillow work with either numpy.
STUB_ENV = Path(sys.prefix) / "triton-env"
STUB_NUMPY = "numpy==1.26.4"


def stub_environment(install: bool = False) -> Path:
    """STUB_ENV, made if missing (`install`: also pip-installs its numpy, which needs the package index)."""
    site = STUB_ENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not (STUB_ENV / "bin" / "python3").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(STUB_ENV)], check=True)
    (site / "diffusion-aot-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if install and not (site / "numpy").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), STUB_NUMPY],
                       check=True)
    if not (site / "numpy").is_dir():
        raise RuntimeError(f"the Triton Python backend of {PYTRITON} needs numpy 1 (numpy 2 corrupts its STRING inputs): "
                           f"`python -c 'from runners.serving.server import stub_environment as s; s(install=True)'` "
                           f"(or `make venv`) puts {STUB_NUMPY} in {STUB_ENV}, the model processes' own venv")
    return STUB_ENV


def tritonserver_home() -> Path:
    spec = importlib.util.find_spec("pytriton")
    home = Path(spec.origin).parent / "tritonserver" if spec and spec.origin else None
    if home is None or not (home / "bin" / "tritonserver").is_file():
        raise RuntimeError(f"serving needs the tritonserver that the nvidia-pytriton wheel ships: {INSTALL}")
    return home


def python_backend(home: Path, folder: Path) -> Path:
    """A backend directory for this interpreter: the wheel's Python backend with the stub built for
    this Python version (the wheel keeps one per version beside it)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        built = sorted(p.name for p in (home / "python_backend_stubs").iterdir())
        raise RuntimeError(f"the Triton Python backend in {home} has stubs for Python {', '.join(built)}, not this "
                           f"Python {version}: serve from a venv of one of those")
    backend = folder / "python"
    backend.mkdir(parents=True)
    # The backend runs the stub found beside its library; links keep the stub's own library path
    # ($ORIGIN/../../../../nvidia_pytriton.libs) working.
    for file in [*(home / "backends" / "python").iterdir(), stub]:
        if file.is_file():
            os.symlink(file, backend / file.name)
    return folder


def _environment() -> dict:
    env = dict(os.environ)
    # The stub runs in the environment of the first python3 on PATH, and links its libpython.
    env["PATH"] = f"{stub_environment() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (for tests and benchmarks that start servers side by side)."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def free_port_block(count: int) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 now (`runners serve --port P` takes P,
    P+1 and P+2), below the range the system takes outgoing connections' ports from."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, s in enumerate(sockets):
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports between 20000 and 32000 on 127.0.0.1")


class Server:
    """tritonserver on `repository`: `with Server(repo, http_port=...) as server:` starts it, waits
    until every model is ready, and stops it (SIGTERM, then SIGKILL after `exit_timeout` s)."""

    def __init__(self, repository, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, log: Path | None = None, exit_timeout: int = 10,
                 extra_args: list[str] | None = None):
        self.repository, self.host = Path(repository).resolve(), host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.exit_timeout = exit_timeout
        self.extra_args = list(extra_args or [])  # more tritonserver options
        self._scratch = tempfile.TemporaryDirectory(prefix="diffusion-aot-triton-")
        self.log = Path(log) if log else Path(self._scratch.name) / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def command(self) -> list[str]:
        home = tritonserver_home()
        backends = python_backend(home, Path(self._scratch.name) / "backends")
        return [str(home / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                f"--backend-directory={backends}", f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                f"--exit-timeout-secs={self.exit_timeout}", "--log-verbose=0", *self.extra_args]

    def start(self, timeout: float = 120.0) -> "Server":
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=_environment(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} while starting; its log "
                                   f"({self.log}) ends:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"tritonserver was not ready after {timeout:.0f} s; its log ends:\n{tail}")
            time.sleep(0.2)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def pids(self) -> list[int]:
        """The server and its Python backend stubs (one process per model instance)."""
        if self.process is None:
            return []
        pids, queue = [], [self.process.pid]
        while queue:
            pid = queue.pop()
            pids.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                queue += [int(c) for c in task.read_text().split()]
        return pids

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory of the server's processes summed ("VmHWM": the peak of each)."""
        total = 0
        for pid in self.pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in status.splitlines()
                           if line.startswith(field + ":")), 0)
        return total

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # Triton drains in-flight requests, then exits
            try:
                self.process.wait(self.exit_timeout + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._scratch.cleanup()

    def __enter__(self) -> "Server":
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info) -> None:
        self.stop()
