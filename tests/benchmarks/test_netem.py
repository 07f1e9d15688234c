"""The namespace cluster manager and the rank launcher (no root needed except the marked test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import netem  # noqa: E402
from benchmarks.netem import Cluster, LaunchError, NetSpec, launch  # noqa: E402


class FakeIP:
    """Records ``ip``/``tc`` commands; keeps a set of namespaces; can fail on a chosen command."""

    def __init__(self, fail_on: str | None = None, existing: list[str] | None = None):
        self.calls: list[list[str]] = []
        self.namespaces: set[str] = set(existing or [])
        self.fail_on = fail_on

    def __call__(self, cmd):
        cmd = list(cmd)
        self.calls.append(cmd)
        if self.fail_on and self.fail_on in " ".join(cmd):
            raise RuntimeError(f"injected failure: {' '.join(cmd)}")
        if cmd[:3] == ["ip", "netns", "add"]:
            self.namespaces.add(cmd[3])
        elif cmd[:3] == ["ip", "netns", "del"]:
            self.namespaces.discard(cmd[3])

    def list_out(self):
        return "\n".join(sorted(self.namespaces))


class LoopbackCluster(Cluster):
    """A Cluster whose ip/tc commands are faked and whose ranks run on loopback."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ifname = "lo"

    def rank_command(self, rank):  # noqa: ARG002
        return []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_netspec_parse():
    assert NetSpec.parse("1gbit") == NetSpec("1gbit", None)
    assert NetSpec.parse("10Gbit, 0.5ms") == NetSpec("10gbit", "0.5ms")
    for bad in ["", "fast", "1gbit,soon", "1gbit,1ms,2", "gbit"]:
        with pytest.raises(ValueError, match="--net"):
            NetSpec.parse(bad)


def test_the_token_bucket_holds_two_ms_of_the_rate_like_a_nic_queue():
    """A NIC banks nothing while idle: tbf's bucket must not let a message that follows compute
    leave at once (512 KiB did: 42 ms of a 100 Mbit/s link)."""
    assert NetSpec.parse("1gbit").bytes_per_s() == 125e6
    assert NetSpec.parse("125mbps").bytes_per_s() == 125e6       # tc's *bps are bytes
    assert NetSpec.parse("10gbit").burst_bytes() == 2_500_000
    assert NetSpec.parse("100mbit").burst_bytes() == netem.MIN_BURST   # 25 KB, raised to the floor
    assert NetSpec.parse("10mbit,1ms").burst_bytes() == netem.MIN_BURST


def test_up_creates_shaped_links_and_down_removes_everything():
    ip = FakeIP()
    c = Cluster(3, "1gbit", runner=ip, list_out=ip.list_out, tag="cpbench-test-")
    with c:
        assert ip.namespaces == {"cpbench-test-br", "cpbench-test-r0", "cpbench-test-r1", "cpbench-test-r2"}
        tbf = [cmd for cmd in ip.calls if "tbf" in cmd]
        assert len(tbf) == 6                     # both ends of 3 links
        assert all("1gbit" in cmd for cmd in tbf)
        assert all(cmd[cmd.index("burst") + 1] == "250000b" for cmd in tbf)   # 2 ms of 1 Gbit/s
        assert c.rank_command(1) == ["ip", "netns", "exec", "cpbench-test-r1"]
        # every address lives inside a namespace of this cluster
        for cmd in ip.calls:
            if "addr" in cmd:
                assert cmd[:3] == ["ip", "-n", cmd[2]] and cmd[2].startswith("cpbench-test-r")
    assert ip.namespaces == set()
    assert c.created == []


def test_delay_falls_back_to_tbf_when_netem_missing():
    ip = FakeIP(fail_on="netem")
    with Cluster(2, "1gbit,1ms", runner=ip, list_out=ip.list_out, tag="cpbench-test-") as c:
        assert any("NOT applied" in n for n in c.notes)
        assert sum("netem" in cmd for cmd in ip.calls) == 1   # probed once, then tbf only
    assert ip.namespaces == set()


def test_failure_during_setup_removes_what_was_created():
    ip = FakeIP(fail_on="cpbench-test-r1 link add")
    with pytest.raises(RuntimeError, match="injected"):
        with Cluster(3, "1gbit", runner=ip, list_out=ip.list_out, tag="cpbench-test-"):
            pass
    assert ip.namespaces == set()


def test_stale_namespaces_of_dead_runs_are_removed():
    dead = _dead_pid()
    mine = f"cpbench-{os.getpid()}-r0"
    ip = FakeIP(existing=[f"cpbench-{dead}-r0", f"cpbench-{dead}-br", mine, "someone-else"])
    c = Cluster(1, None, runner=ip, list_out=ip.list_out, tag="cpbench-test-")
    removed = c.cleanup_stale()
    assert sorted(removed) == sorted([f"cpbench-{dead}-r0", f"cpbench-{dead}-br"])
    assert ip.namespaces == {mine, "someone-else"}


def test_sigterm_tears_down():
    ip = FakeIP()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        with Cluster(2, "1gbit", runner=ip, list_out=ip.list_out, tag="cpbench-test-"):
            assert ip.namespaces
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    assert ip.namespaces == set()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.timeout(90)
def test_launch_cleans_up_when_a_rank_fails():
    ip = FakeIP()
    msgs = []
    with LoopbackCluster(3, "1gbit", runner=ip, list_out=ip.list_out, tag="cpbench-test-") as c:
        with pytest.raises(LaunchError, match="failing on purpose"):
            launch("benchmarks.netem:echo_target", 3, cluster=c, kwargs={"fail_rank": 1},
                   on_message=lambda r, m: msgs.append((r, m)), timeout=60, pg_timeout=10, grace=5)
    assert ip.namespaces == set()


@pytest.mark.timeout(90)
@pytest.mark.skipif(Cluster.probe() is not None, reason=f"network namespaces unavailable: {Cluster.probe()}")
def test_real_namespaces_rate_limited_allreduce_and_cleanup():
    with Cluster(2, "1gbit") as c:
        tag = c.tag
        msgs = []
        out = launch("benchmarks.netem:echo_target", 2, cluster=c, kwargs={"numel": 1000}, timeout=60,
                     on_message=lambda r, m: msgs.append((r, m)))
        assert [o["sum"] for o in out] == [3.0, 3.0]
        assert sorted(r for r, _ in msgs) == [0, 1]
        assert {o["ifname"] for o in out} == {netem.IFNAME}
        with pytest.raises(LaunchError):
            launch("benchmarks.netem:echo_target", 2, cluster=c, kwargs={"fail_rank": 0},
                   timeout=60, pg_timeout=10, grace=5)
    assert not [ns for ns in netem.list_namespaces() if ns.startswith(tag)]


def test_topology_puts_a_node_in_one_namespace_and_throttles_only_node_links():
    fake = FakeIP()
    c = Cluster(4, "1gbit", runner=fake, list_out=fake.list_out, tag="cpbench-999999-", topology="2x2")
    with c:
        assert c.rank_ns == ["cpbench-999999-n0", "cpbench-999999-n0", "cpbench-999999-n1", "cpbench-999999-n1"]
        assert c.rank_command(1)[-1] == c.rank_command(0)[-1] != c.rank_command(2)[-1]
        shaped = [cmd for cmd in fake.calls if "tc" in cmd]
        assert len(shaped) == 4            # 2 node links x (egress + ingress)
        assert "2 nodes x 2 ranks" in c.describe()
    assert fake.namespaces == set()         # everything removed


@pytest.mark.parametrize("bad", ["2x3", "4", "x2", "0x4"])
def test_topology_must_describe_the_world(bad):
    with pytest.raises(ValueError):
        Cluster(4, "1gbit", runner=FakeIP(), topology=bad)
