import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_cuda() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()


#: files of the suite's longest tests (each 20-130 s on 2 cores), run first: with two pytest-xdist
#: workers taking one file at a time in collection order, the top-level test_examples.py came last
#: and left one worker idle while the other ran it
SLOW_FIRST = ("test_examples.py", "benchmarks/test_gpu_check.py", "hooks/test_ddp_train.py",
              "compressors/test_train_momentum.py", "hooks/test_fsdp.py", "ops/test_ops_cuda_parity.py",
              "benchmarks/test_sweep.py")   # paths under tests/


def _slow_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((i for i, slow in enumerate(SLOW_FIRST) if path.endswith("/" + slow)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)   # stable: the rest keep their order
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
