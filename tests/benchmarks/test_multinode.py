"""benchmarks.multinode without root: teardown order, the agents' command lines, finding a worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.multinode import NodeCluster, agent_command, main, worker_pid  # noqa: E402
from benchmarks.netem import Cluster  # noqa: E402
from tests.benchmarks.test_netem import FakeIP  # noqa: E402


def test_veth_host_ends_go_before_their_namespaces():
    ip = FakeIP()
    with NodeCluster(4, "1gbit", runner=ip, list_out=ip.list_out, tag="cpbench-test-", topology="2x2") as c:
        assert c.hosts == ["cpbench-test-n0", "cpbench-test-n1"]
    assert not ip.namespaces
    dels = [" ".join(cmd) for cmd in ip.calls if "del" in cmd]
    host_ends = [i for i, d in enumerate(dels) if d.startswith("ip -n cpbench-test-br link del cpbp")]
    ns_dels = [i for i, d in enumerate(dels) if d.startswith("ip netns del")]
    assert len(host_ends) == 2 and len(ns_dels) == 3 and max(host_ends) < min(ns_dels)


def test_teardown_on_failure_removes_what_was_made():
    ip = FakeIP(fail_on="cpbp1 master")
    with pytest.raises(RuntimeError, match="injected"):
        with NodeCluster(4, "1gbit", runner=ip, list_out=ip.list_out, tag="cpbench-test-", topology="2x2"):
            pass
    assert not ip.namespaces


def test_agent_command_targets_node0_and_its_own_address():
    c = Cluster(4, "1gbit", runner=FakeIP(), tag="cpbench-test-", topology="2x2")
    cmd = agent_command(c, 1, 12345, "rid", 2, 1, ["--steps", "3"])
    assert cmd[:4] == ["ip", "netns", "exec", "cpbench-test-n1"]
    assert f"--rdzv_endpoint={c.addr(0)}:12345" in cmd and f"--local_addr={c.addr(1)}" in cmd
    assert "--nnodes=2" in cmd and "--nproc_per_node=2" in cmd and "--max-restarts=1" in cmd
    assert "--rdzv_conf=is_host=false,join_timeout=120" in cmd
    assert cmd[-2:] == ["--steps", "3"]


def test_worker_pid_finds_a_descendant_by_local_rank():
    code = "import subprocess, sys, os; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'], env={**os.environ, 'LOCAL_RANK': '1'})"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(200):
            pid = worker_pid(parent.pid, 1)
            if pid is not None:
                break
            subprocess.run(["sleep", "0.05"])
        assert pid is not None and pid != parent.pid
        assert worker_pid(parent.pid, 0) is None
        os.kill(pid, 9)
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the message given without root")
def test_without_root_says_why(capsys):
    assert main([]) == 2
    assert "root" in capsys.readouterr().err
