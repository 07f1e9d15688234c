"""An emulated cluster on one machine, and a launcher for multi-rank benchmark code.

:class:`Cluster` puts every rank in its own Linux network namespace, joined by
veth links to a bridge that lives in a namespace of its own, with a ``tc``
token-bucket (``tbf``) rate limit on both ends of each link (a full-duplex NIC)
and ``netem`` delay where the kernel has it.  Nothing outside the namespaces it
creates is touched: the private subnet exists only inside them, so clusters of
concurrent runs never see each other.  It removes everything it created on
exit, on exceptions and on SIGINT/SIGTERM, and at start removes namespaces left
behind by dead runs (names ``cpbench-<pid>-...`` whose pid is gone).

``topology=(nodes, local)`` (``--topology 2x2``) emulates nodes instead: the
``local`` ranks of a node share one namespace (they talk over its loopback,
unthrottled) and only the node's one veth link, shared by its ranks like a NIC,
is rate limited.  :func:`nic_bytes` reads that link's counters from inside a rank
(bytes crossing nodes, TCP/IP headers included).

Without root, ``ip``/``tc`` or namespace support it says why (``Cluster.probe``)
and :func:`launch` runs the ranks on loopback.

:func:`launch` runs ``module:function`` on ``world_size`` rank processes
(one subprocess each, gloo over the namespace interface or loopback, a
``FileStore`` on a shared temp file for rendezvous, one torch thread each)::

    from benchmarks.netem import launch
    results = launch("benchmarks.collectives:rank_main", 4, net="1gbit",
                     kwargs={"sizes": [2**20]})

The function is called as ``fn(rank, world_size, report=report, **kwargs)``
after ``torch.distributed`` is initialised; its return value must be
picklable and comes back in rank order.  ``report(dict)`` sends a message to
the parent immediately (``on_message(rank, dict)``), e.g. progress.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger("commpress.benchmarks")

PREFIX = "cpbench-"
IFNAME = "cpbeth0"          # the rank's interface, same name inside every rank namespace
SUBNET = "10.213.0"         # only ever configured inside namespaces this module creates
MARKER = "@@cpbench "       # stdout lines from ranks that carry report() messages
REPO_ROOT = Path(__file__).resolve().parent.parent

Runner = Callable[[Sequence[str]], None]

_RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$", re.I)
_DELAY_RE = re.compile(r"^\d+(\.\d+)?(us|ms|s)$", re.I)
#: tbf's bucket, in seconds of the rate (:meth:`NetSpec.burst_bytes`): measured on 2 namespaces, an
#: all_reduce after 13 ms of idle took 18.3 ms for 2.25 MB at 1 Gbit/s (18.0 at the rate) and 21.6 ms
#: for 270 KB at 100 Mbit/s (21.6), against 15.6 and 9.1 ms with the 512 KiB bucket used before
BURST_S = 0.002
MIN_BURST = 32 * 1024


@dataclasses.dataclass(frozen=True)
class NetSpec:
    """A link: ``rate`` in tc syntax (``1gbit``) and optional one-way ``delay`` (``0.5ms``)."""

    rate: str
    delay: str | None = None

    @classmethod
    def parse(cls, text: str) -> "NetSpec":
        """Parse ``RATE[,DELAY]`` such as ``1gbit`` or ``1gbit,0.5ms``."""
        parts = [p.strip() for p in text.split(",")]
        if not parts or len(parts) > 2 or not _RATE_RE.match(parts[0]):
            raise ValueError(f"--net must be RATE[,DELAY] like '1gbit' or '10gbit,0.5ms', got {text!r}")
        delay = parts[1] if len(parts) == 2 else None
        if delay is not None and not _DELAY_RE.match(delay):
            raise ValueError(f"--net delay must look like '0.5ms', '200us' or '1s', got {delay!r}")
        return cls(parts[0].lower(), delay)

    def __str__(self) -> str:
        return self.rate + (f",{self.delay}" if self.delay else "")

    def bytes_per_s(self) -> float:
        """The rate in bytes per second (tc's units: ``*bit`` are bits, ``*bps`` bytes; SI prefixes)."""
        m = re.match(r"^(\d+(?:\.\d+)?)([a-z]*)$", self.rate)
        value, unit = float(m.group(1)), m.group(2)
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit[0] if unit[0] in "kmgt" else ""]
        return value * scale / (8 if unit.endswith("bit") else 1)

    def burst_bytes(self) -> int:
        """tbf's bucket: what the link may send at the veth's speed after idling.  A NIC banks
        nothing while idle; a large bucket lets a message that follows compute leave at once (at
        100 Mbit/s a 512 KiB bucket sent a 270 KB all_reduce in 9 ms, not the 21.6 ms of the
        rate).  ``BURST_S`` of the rate, at least ``MIN_BURST`` (tbf needs a bucket above the
        largest packet and the timer's granularity: 64 KiB ran 1 Gbit/s 34% slow)."""
        return max(MIN_BURST, int(self.bytes_per_s() * BURST_S))


def _run(cmd: Sequence[str]) -> None:
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces(runner_out: Callable[[], str] | None = None) -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    if runner_out is None:
        res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        out = res.stdout if res.returncode == 0 else ""
    else:
        out = runner_out()
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Cluster:
    """Network namespaces for ``world_size`` ranks behind one rate-limited bridge.

    Use as a context manager.  ``rank_command(rank)`` is the prefix that runs a
    program inside rank ``rank``'s namespace; ``ifname`` is the interface gloo
    must bind to.  ``runner`` executes ``ip``/``tc`` argument lists (injectable
    for tests); ``list_out`` returns ``ip netns list`` output.
    """

    def __init__(self, world_size: int, net: NetSpec | str | None = None, *,
                 runner: Runner | None = None, list_out: Callable[[], str] | None = None,
                 tag: str | None = None, topology: tuple[int, int] | str | None = None) -> None:
        if not isinstance(world_size, int) or not 1 <= world_size <= 64:
            raise ValueError(f"world_size must be an int in [1, 64], got {world_size!r}")
        self.topology = parse_topology(topology, world_size) if topology is not None else None
        self.world_size = world_size
        self.net = NetSpec.parse(net) if isinstance(net, str) else net
        self._runner = runner or _run
        self._list_out = list_out
        self.tag = tag or f"{PREFIX}{os.getpid()}-"
        self.bridge_ns = f"{self.tag}br"
        if self.topology is None:
            self.hosts = [f"{self.tag}r{r}" for r in range(world_size)]
            self.rank_ns = list(self.hosts)
        else:
            local = self.topology[1]
            self.hosts = [f"{self.tag}n{i}" for i in range(self.topology[0])]
            self.rank_ns = [self.hosts[r // local] for r in range(world_size)]
        self.ifname = IFNAME
        self.created: list[str] = []
        self.notes: list[str] = []
        self._old_handlers: dict[int, Any] = {}
        self._netem_ok: bool | None = None

    # -- probing -----------------------------------------------------------
    @staticmethod
    def probe() -> str | None:
        """``None`` when namespaces can be used here, else the reason why not."""
        if os.name != "posix" or not sys.platform.startswith("linux"):
            return f"network namespaces need Linux (this is {sys.platform})"
        if os.geteuid() != 0:
            return "not running as root (network namespaces need CAP_NET_ADMIN)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` (iproute2) not found"
        name = f"{PREFIX}{os.getpid()}-probe"
        res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if res.returncode != 0:
            return f"`ip netns add` failed: {res.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        return None

    def addr(self, host: int) -> str:
        """Host ``host``'s address (a rank, or a node with a topology; exists only inside
        the cluster's namespaces)."""
        return f"{SUBNET}.{host + 1}"

    def rank_command(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.rank_ns[rank]]

    # -- lifecycle ---------------------------------------------------------
    def cleanup_stale(self) -> list[str]:
        """Remove ``cpbench-<pid>-*`` namespaces whose creating process is gone."""
        removed = []
        for ns in list_namespaces(self._list_out):
            m = re.match(rf"^{re.escape(PREFIX)}(\d+)-", ns)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                try:
                    self._runner(["ip", "netns", "del", ns])
                    removed.append(ns)
                except RuntimeError as exc:
                    log.warning("could not remove stale namespace %s: %s", ns, exc)
        if removed:
            log.warning("removed stale namespaces from dead runs: %s", ", ".join(removed))
        return removed

    def _add_ns(self, name: str) -> None:
        self._runner(["ip", "netns", "add", name])
        self.created.append(name)

    def _shape(self, ns: str, dev: str) -> None:
        """Rate (tbf) and, where the kernel has netem, delay on ``dev``'s egress."""
        assert self.net is not None
        if self.net.delay and self._netem_ok is not False:
            try:
                self._runner(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                              "netem", "rate", self.net.rate, "delay", self.net.delay, "limit", "100000"])
                self._netem_ok = True
                return
            except RuntimeError as exc:
                if self._netem_ok:
                    raise
                self._netem_ok = False
                note = (f"netem qdisc unavailable in this kernel ({exc}); delay {self.net.delay} NOT "
                        f"applied, rate limited with tbf only")
                self.notes.append(note)
                log.warning(note)
        # burst: 2 ms of the rate (NetSpec.burst_bytes), what a NIC's queue allows; latency bounds the queue
        self._runner(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                      "tbf", "rate", self.net.rate, "burst", f"{self.net.burst_bytes()}b", "latency", "200ms"])

    def up(self) -> "Cluster":
        """Create namespaces, bridge, veths, addresses and shaping."""
        self.cleanup_stale()
        self._add_ns(self.bridge_ns)
        self._runner(["ip", "-n", self.bridge_ns, "link", "add", "cpbr0", "type", "bridge"])
        self._runner(["ip", "-n", self.bridge_ns, "link", "set", "cpbr0", "up"])
        for r, ns in enumerate(self.hosts):
            self._add_ns(ns)
            peer = f"cpbp{r}"
            self._runner(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._runner(["ip", "-n", ns, "link", "add", self.ifname, "type", "veth",
                          "peer", "name", peer, "netns", self.bridge_ns])
            self._runner(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", self.ifname])
            self._runner(["ip", "-n", ns, "link", "set", self.ifname, "up"])
            self._runner(["ip", "-n", self.bridge_ns, "link", "set", peer, "master", "cpbr0"])
            self._runner(["ip", "-n", self.bridge_ns, "link", "set", peer, "up"])
            if self.net is not None:
                self._shape(ns, self.ifname)           # rank's egress
                self._shape(self.bridge_ns, peer)      # rank's ingress
        return self

    def down(self) -> None:
        """Delete every namespace this cluster created (veths go with them). Idempotent."""
        errors = []
        while self.created:
            ns = self.created.pop()
            try:
                self._runner(["ip", "netns", "del", ns])
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            log.warning("cluster teardown problems: %s", "; ".join(errors))

    def _on_signal(self, signum, frame):  # noqa: ARG002
        # Unwind: launch() kills the rank processes in its ``finally``, then
        # ``__exit__`` deletes the namespaces.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __enter__(self) -> "Cluster":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self.down)
        try:
            self.up()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            self._old_handlers.clear()
            atexit.unregister(self.down)

    def describe(self) -> str:
        shaping = (f"tc {self.net} (bucket {self.net.burst_bytes() // 1000} KB) on both ends of every veth"
                   if self.net else "no rate limit")
        if self.topology is not None:
            nodes, local = self.topology
            return (f"{nodes} nodes x {local} ranks: one network namespace per node ({self.tag}n*, ranks of "
                    f"a node over its loopback, unthrottled) + bridge ns {self.bridge_ns}, {shaping} "
                    f"(between nodes only)" + (f"; {'; '.join(self.notes)}" if self.notes else ""))
        return (f"{self.world_size} network namespaces ({self.tag}r*) + bridge ns {self.bridge_ns}, "
                f"{shaping}" + (f"; {'; '.join(self.notes)}" if self.notes else ""))


def parse_topology(text: tuple[int, int] | str, world_size: int) -> tuple[int, int]:
    """``"2x2"`` (nodes x ranks per node) or a tuple; their product must be ``world_size``."""
    if isinstance(text, str):
        m = re.match(r"^(\d+)x(\d+)$", text.strip())
        if not m:
            raise ValueError(f"--topology must be NODESxRANKS like '2x2', got {text!r}")
        nodes, local = int(m.group(1)), int(m.group(2))
    else:
        nodes, local = (int(v) for v in text)
    if nodes < 1 or local < 1 or nodes * local != world_size:
        raise ValueError(f"topology {nodes}x{local} does not describe {world_size} ranks")
    return nodes, local


def nic_bytes() -> int | None:
    """Bytes sent by this namespace's cluster interface so far (``None`` off a cluster:
    on loopback every byte is local).  Read from sysfs inside a rank process."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if name != IFNAME:
        return None
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


class Loopback:
    """Stand-in for :class:`Cluster` when namespaces are unavailable: plain loopback."""

    ifname = "lo"
    notes: list[str] = []

    def __init__(self, world_size: int, reason: str = "") -> None:
        self.world_size = world_size
        self.reason = reason

    def rank_command(self, rank: int) -> list[str]:  # noqa: ARG002
        return []

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def describe(self) -> str:
        return "loopback (no rate limit)" + (f": {self.reason}" if self.reason else "")


def make_cluster(world_size: int, net: NetSpec | str | None,
                 topology: tuple[int, int] | str | None = None) -> Cluster | Loopback:
    """A :class:`Cluster` when ``net`` is given and namespaces work here, else :class:`Loopback`."""
    if topology is not None:
        parse_topology(topology, world_size)
    if net is None:
        return Loopback(world_size)
    spec = NetSpec.parse(net) if isinstance(net, str) else net
    reason = Cluster.probe()
    if reason is not None:
        log.warning("--net %s requested but %s: running on loopback without rate limits", spec, reason)
        return Loopback(world_size, f"--net {spec} requested but {reason}")
    return Cluster(world_size, spec, topology=topology)


# ---------------------------------------------------------------------------
# launching rank processes
# ---------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """A rank failed or the run timed out; ``logs`` holds each rank's last output lines."""

    def __init__(self, message: str, logs: dict[int, str]) -> None:
        detail = "\n".join(f"--- rank {r} (last lines):\n{text}" for r, text in sorted(logs.items()) if text)
        super().__init__(message + ("\n" + detail if detail else ""))
        self.logs = logs


def _reader(rank: int, stream, tail: deque, on_message, echo: bool) -> None:
    for line in iter(stream.readline, ""):
        if line.startswith(MARKER):
            try:
                msg = json.loads(line[len(MARKER):])
            except json.JSONDecodeError:
                tail.append(line.rstrip())
                continue
            if on_message is not None:
                on_message(rank, msg)
        else:
            tail.append(line.rstrip())
            if echo:
                sys.stderr.write(f"[rank {rank}] {line}")
    stream.close()


def launch(target: str, world_size: int, *, net: NetSpec | str | None = None,
           cluster: Cluster | Loopback | None = None, kwargs: dict[str, Any] | None = None,
           timeout: float = 3600.0, pg_timeout: float = 120.0,
           on_message: Callable[[int, dict], None] | None = None, echo: bool = False,
           grace: float = 10.0, env: dict[str, str] | None = None, pin: bool = False,
           topology: tuple[int, int] | str | None = None) -> list[Any]:
    """Run ``target`` (``"package.module:function"``) on ``world_size`` rank processes.

    Pass ``cluster`` (an entered :class:`Cluster`/:class:`Loopback`) to reuse one
    across launches, or ``net`` to have one made and torn down around this call.
    Returns the per-rank return values.  Raises :class:`LaunchError` when a rank
    exits non-zero (the others are killed after ``grace`` seconds) or when
    ``timeout`` passes.  ``pin``: rank ``r`` and every thread it starts run on one
    core, the ``r % n``-th of the ``n`` cores this process may use (set before torch
    is imported), as ranks with cores of their own would.
    """
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    if cluster is None:
        with make_cluster(world_size, net, topology) as made:
            return launch(target, world_size, cluster=made, kwargs=kwargs, timeout=timeout,
                          pg_timeout=pg_timeout, on_message=on_message, echo=echo, grace=grace, env=env,
                          pin=pin)
    with tempfile.TemporaryDirectory(prefix="cpbench-") as tmp:
        spec = {"target": target, "world_size": world_size, "store": os.path.join(tmp, "store"),
                "kwargs": kwargs or {}, "pg_timeout": pg_timeout, "out": tmp,
                "cpus": sorted(os.sched_getaffinity(0)) if pin else None}
        spec_path = os.path.join(tmp, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        base_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1",  # what torchrun sets; numba follows torch (no NUMBA_* needed)
                    "GLOO_SOCKET_IFNAME": cluster.ifname, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        procs: list[subprocess.Popen] = []
        tails: dict[int, deque] = {}
        threads = []
        try:
            for r in range(world_size):
                cmd = cluster.rank_command(r) + [sys.executable, "-m", "benchmarks.netem", spec_path, str(r)]
                # own process group: `ip netns exec` may fork, so the whole group is killed at the end
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=base_env, cwd=str(REPO_ROOT), start_new_session=True)
                procs.append(p)
                tails[r] = deque(maxlen=40)
                t = threading.Thread(target=_reader, args=(r, p.stdout, tails[r], on_message, echo), daemon=True)
                t.start()
                threads.append(t)
            deadline = time.monotonic() + timeout
            failed_at = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    break
                bad = [r for r, c in enumerate(codes) if c not in (0, None)]
                now = time.monotonic()
                if bad and failed_at is None:
                    failed_at = now
                if failed_at is not None and (all(c is not None for c in codes) or now - failed_at > grace):
                    raise LaunchError(f"rank(s) {bad} exited with codes {[codes[r] for r in bad]}",
                                      {r: "\n".join(tails[r]) for r in range(world_size)})
                if now > deadline:
                    raise LaunchError(f"timed out after {timeout:.0f}s",
                                      {r: "\n".join(tails[r]) for r in range(world_size)})
                time.sleep(0.05)
            for t in threads:
                t.join(timeout=5)
            out = []
            for r in range(world_size):
                with open(os.path.join(tmp, f"result-{r}.pkl"), "rb") as f:
                    out.append(pickle.load(f))
            return out
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)   # the rank and anything `ip netns exec` forked
                except (ProcessLookupError, PermissionError):
                    pass
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.warning("rank process %d did not exit after kill", p.pid)


def echo_target(rank: int, world_size: int, *, report: Callable[[dict], None], numel: int = 4,
                fail_rank: int | None = None) -> dict[str, Any]:
    """A tiny rank function for smoke tests: one all_reduce; ``fail_rank`` raises instead."""
    import torch
    import torch.distributed as dist

    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} failing on purpose")
    x = torch.full((numel,), float(rank + 1))
    dist.all_reduce(x)
    report({"rank": rank, "sum": float(x[0])})
    return {"rank": rank, "sum": float(x[0]), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "cpus": sorted(os.sched_getaffinity(0))}


def _worker(spec_path: str, rank: int) -> int:
    """Body of one rank process (``python -m benchmarks.netem SPEC RANK``)."""
    import datetime
    import importlib

    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    if spec.get("cpus"):                       # before torch starts any thread
        os.sched_setaffinity(0, {spec["cpus"][rank % len(spec["cpus"])]})

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world_size = spec["world_size"]

    def report(msg: dict) -> None:
        sys.stdout.write(MARKER + json.dumps(msg, default=str) + "\n")
        sys.stdout.flush()

    module_name, fn_name = spec["target"].split(":", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    store = dist.FileStore(spec["store"], world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
    try:
        result = fn(rank, world_size, report=report, **spec["kwargs"])
    finally:
        dist.destroy_process_group()
    tmp_path = os.path.join(spec["out"], f"result-{rank}.pkl.tmp")
    with open(tmp_path, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp_path, os.path.join(spec["out"], f"result-{rank}.pkl"))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], int(sys.argv[2])))
