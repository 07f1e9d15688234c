import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import RankError, run


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 3])
def test_run_collects_results_in_rank_order(world_size):
    expected = world_size * (world_size + 1) / 2
    assert run(_allreduce_rank, world_size) == [expected] * world_size


@pytest.mark.timeout(60)
def test_run_reports_rank_errors():
    with pytest.raises(RuntimeError, match="boom"):
        run(_raise_on_one, 2)
    out = run(_raise_on_one, 2, return_exceptions=True)
    assert out[0] == 0 and isinstance(out[1], RankError) and out[1].type == "ValueError"



def _abnormal_exit_after_returning(rank, world_size):
    import multiprocessing.util

    if rank == 1:  # after its result is flushed (the queue's feeder joins at priority -5)
        multiprocessing.util.Finalize(None, os._exit, args=(7,), exitpriority=-10)
    return rank


def _exit_silently(rank, world_size):
    if rank == 1:
        os._exit(0)   # no result, exit code 0: reported at once, not at the timeout
    return rank


def _sleep_writing_pid(rank, world_size, tmp):
    with open(os.path.join(tmp, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


@pytest.mark.timeout(60)
def test_run_reports_exit_codes():
    with pytest.raises(RuntimeError, match="AbnormalExit: exit code 7 after it returned"):
        run(_abnormal_exit_after_returning, 2)
    out = run(_abnormal_exit_after_returning, 2, return_exceptions=True)
    assert out[0] == 0 and isinstance(out[1], RankError) and out[1].type == "AbnormalExit"
    t0 = time.monotonic()
    out = run(_exit_silently, 2, timeout=50, return_exceptions=True)
    assert out[0] == 0 and out[1].type == "ProcessDied" and "exit code 0" in out[1].message
    assert time.monotonic() - t0 < 40


@pytest.mark.timeout(60)
def test_a_timeout_leaves_no_rank_behind(tmp_path):
    with pytest.raises(TimeoutError, match="did not finish within 2"):
        run(_sleep_writing_pid, 2, str(tmp_path), timeout=2)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    for pid in pids:   # killed and reaped before run() returned (its store and queue went after)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _Interrupted(Exception):
    """Stands in for pytest-timeout's exception, raised while a slow forkserver starts a rank."""


@pytest.mark.timeout(60)
def test_an_interrupted_start_leaves_no_rank_behind(monkeypatch, tmp_path):
    import distributed

    cls = distributed._context().Process
    start = cls.start
    started = []

    def start_then_interrupt(self):
        if started:
            raise _Interrupted("while starting rank 1")
        start(self)
        started.append(self)

    monkeypatch.setattr(cls, "start", start_then_interrupt)
    with pytest.raises(_Interrupted):
        run(_sleep_writing_pid, 2, str(tmp_path), timeout=30)
    # rank 0 was killed before its store's directory and the queue went (else it would wait for
    # rank 1, then fail on the removed store or the queue's unlinked semaphores on its own)
    assert started[0].exitcode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(started[0].pid, 0)
