"""`specinfer serve`: the verifier, N speculators and the manager as separate processes.

Internal services listen on free ports of the host (each prints "<name> listening on <address>"
once serving); the manager is started last, pointed at them, on the public port. The launcher
checks every service's gRPC health, prints the manager's address, and on SIGTERM or SIGINT stops
them all (SIGTERM, then SIGKILL after the grace period). Each service's stderr passes through the
launcher (to its own stderr, or a log file), which keeps its last lines: a service that dies at start
is named with its error (`ServiceFailed`).
"""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specinfer.eagle import head_layers

from .healthcheck import check


@dataclass
class Service:
    name: str
    module: str
    args: list[str]
    process: subprocess.Popen | None = None
    address: str = ""
    metrics: str = ""  # its /metrics URL, when it serves one
    http: str = ""  # an HTTP service's scheme (the gateway: "http" or "https"); its health is GET /health
    source: Path = Path(__file__).resolve().parent.parent  # the source tree it runs from (e.g. another checkout, to compare)
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=20))  # its last lines on stderr

    def last_error(self) -> str:
        """The last non-blank line it wrote to stderr (a traceback's last line names the error)."""
        return next((line.strip() for line in reversed(self.stderr_tail) if line.strip()), "")

    @property
    def url(self) -> str:
        """An HTTP service's base URL."""
        return f"{self.http}://{self.address}"


class ServiceFailed(RuntimeError):
    """A service exited before it was listening: its name, exit code and the last line of its error."""

    def __init__(self, service: Service, code: int):
        error = service.last_error()
        super().__init__(f"{service.name} failed at start (exit code {code})" + (f": {error}" if error else ""))


FRONT = ("gateway_svc", "manager_svc")  # what clients call; stopped before the services they call


@dataclass
class System:
    services: list[Service] = field(default_factory=list)
    log_dir: Path | None = None  # each service's stderr to <log_dir>/<name>.log (default: inherited)
    credentials: grpc.ChannelCredentials | None = None  # for the health checks, when the services serve TLS
    ssl_context: ssl.SSLContext | None = None  # for the gateway's health check, when it serves HTTPS

    @property
    def manager(self) -> Service:
        return self.by_name("manager")

    @property
    def gateway(self) -> Service | None:
        return next((s for s in self.services if s.name == "gateway"), None)

    def by_name(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def start(self, name: str, module: str, args: list[str], timeout: float, http: str = "",
              source: Path | None = None) -> Service:
        """Start `python -m module args` (from the source tree `source`, default this one), wait until
        it is listening and healthy."""
        service = Service(name, module, args, http=http, **({"source": source} if source else {}))
        self.services.append(service)
        self._run(service, timeout)
        return service

    def restart(self, service: Service, timeout: float = 120.0) -> None:
        """Start a service that exited again, on the same address."""
        args = list(service.args)
        args[args.index("--port") + 1] = service.address.rsplit(":", 1)[1]
        service.args = args
        self._run(service, timeout)

    def _run(self, service: Service, timeout: float) -> None:
        sink = sys.stderr
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            sink = open(self.log_dir / f"{service.name}.log", "a")
        proc = service.process = subprocess.Popen([sys.executable, "-m", service.module, *service.args],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                  cwd=service.source)
        relay = threading.Thread(target=_relay, args=(proc.stderr, sink, service.stderr_tail), daemon=True,
                                 name=f"{service.name}-stderr")
        relay.start()
        address = ""
        for line in proc.stdout:  # the service prints nothing else on stdout; EOF if it dies
            if " metrics on " in line:
                service.metrics = line.split(" metrics on ")[1].strip()
            if " listening on " in line:
                address = line.split(" listening on ")[1].strip()
                break
        if not address:
            code = proc.wait()
            relay.join(timeout=5)  # its stderr to the end
            self.stop()
            raise ServiceFailed(service, code)
        service.address = address
        if service.http:
            wait_healthy(service.url, lambda: http_serving(service.url, self.ssl_context), timeout)
        else:
            wait_healthy(address, lambda: grpc_serving(address, self.credentials), timeout)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the front (gateway, managers) first and wait for it to drain, then the back
        (speculators, verifier): a backend then stops with no stream from a manager still open, so
        its server never cancels a call that is just ending (gRPC logs that race as a traceback).
        Each group gets `grace` seconds before it is killed."""
        front = [s for s in self.services if s.module in FRONT]
        for group in (front, [s for s in self.services if s.module not in FRONT]):
            for s in reversed(group):
                if s.process.poll() is None:
                    s.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for s in group:
                try:
                    s.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    s.process.kill()
                    s.process.wait()


def _relay(stream, sink, tail: deque) -> None:
    """A service's stderr, line by line, to `sink` (the launcher's stderr or the service's log file), its
    last lines kept in `tail`; a log file is closed at the service's end."""
    try:
        for line in stream:
            tail.append(line)
            try:
                sink.write(line if line.endswith("\n") else line + "\n")  # its last words end a line too
                sink.flush()
            except (OSError, ValueError):  # the launcher's stderr closed: keep draining the pipe
                pass
    finally:
        if sink is not sys.stderr:
            sink.close()


def grpc_serving(address: str, credentials: grpc.ChannelCredentials | None = None) -> bool:
    try:
        return check(address, timeout=2, credentials=credentials) == "SERVING"
    except grpc.RpcError:
        return False


def http_serving(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2, context=context) as r:
            return r.status == 200
    except OSError:  # refused, or 503 (urllib.error.HTTPError is an OSError)
        return False


def wait_healthy(what: str, serving, timeout: float) -> None:
    """Poll `serving()` until it is true; RuntimeError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not serving():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {timeout}s")
        time.sleep(0.2)


def start_backends(system: System, llm: str | Path, ssms: list[Path], speculators: int, heads: list[Path] = (),
                   common: list[str] = ("--port", "0"), verifier_args: list[str] = (), speculator_args: list[str] = (),
                   timeout: float = 120.0, source: Path | None = None) -> tuple[Service, list[Service]]:
    """The verifier and the speculators a manager is pointed at: speculator i hosts ssms[i % len(ssms)]
    (none without SSMs), then one speculator per feature drafter in `heads` (the verifier then returns
    the features they read). `common` goes to each of them, every service runs from `source` (default
    this tree)."""
    layers = sorted({head_layers(h, llm) for h in heads})
    if len(layers) > 1:
        raise ValueError(f"heads: they read different layers of the LLM ({layers})")
    features = [f"--feature-layers={','.join(map(str, layers[0]))}"] if layers else []
    verifier = system.start("verifier", "verifier_svc", ["--model", str(llm), *common, *features, *verifier_args],
                            timeout, source=source)
    specs = [system.start(f"speculator-{i}", "speculator_svc",
                          ["--ssm", str(ssms[i % len(ssms)]), "--threads", "1", *common, *speculator_args], timeout,
                          source=source)
             for i in range(speculators if ssms else 0)]
    specs += [system.start(f"speculator-head-{i}", "speculator_svc",
                           ["--ssm=", "--head", str(h), "--llm", str(llm), "--threads", "1", *common, *speculator_args],
                           timeout, source=source)
              for i, h in enumerate(heads)]
    return verifier, specs


def launch(llm: Path, ssms: list[Path], speculators: int, host: str = "127.0.0.1", port: int = 50051,
           dtype: str = "auto", manager_args: list[str] = (), verifier_args: list[str] = (),
           timeout: float = 120.0, log_dir: Path | None = None, service_args: list[str] = (),
           credentials: grpc.ChannelCredentials | None = None, http_port: int | None = None,
           ssl_context: ssl.SSLContext | None = None, heads: list[Path] = ()) -> System:
    """Start the whole system: the verifier and the speculators (`start_backends`), the manager and,
    with `http_port`, the HTTP gateway in front of it. `service_args` go to every service (e.g. TLS
    flags; then `credentials` and `ssl_context` are what the health checks connect with)."""
    system = System(log_dir=log_dir, credentials=credentials, ssl_context=ssl_context)
    try:
        common = ["--host", host, "--port", "0", "--dtype", dtype, "--metrics-port", "0", *service_args]
        verifier, specs = start_backends(system, llm, ssms, speculators, heads, common, verifier_args, timeout=timeout)
        system.start("manager", "manager_svc",
                     ["--host", host, "--port", str(port), "--metrics-port", "0", *service_args,
                      "--verifier", verifier.address, "--tokenizer", str(llm),
                      "--speculators", ",".join(s.address for s in specs), *manager_args], timeout)
        if http_port is not None:
            system.start("gateway", "gateway_svc",
                                   ["--host", host, "--port", str(http_port), *service_args,
                                    "--manager", system.manager.address, "--tokenizer", str(llm)], timeout,
                         http="https" if ssl_context is not None else "http")
    except BaseException:
        system.stop()
        raise
    return system


def serve_forever(system: System) -> int:
    """Until SIGTERM/SIGINT: restart a verifier or speculator that exits (the manager keeps every
    request's record, so nothing accepted is lost); if the manager exits, stop everything."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        while not stop:
            for s in system.services:
                code = s.process.poll()
                if code is None:
                    continue
                print(f"specinfer serve: {s.name} exited with code {code}", file=sys.stderr, flush=True)
                if s.name == "manager":
                    return 1
                system.restart(s)
            time.sleep(0.2)
    finally:
        system.stop()
    return 0
