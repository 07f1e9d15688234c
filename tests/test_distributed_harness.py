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

