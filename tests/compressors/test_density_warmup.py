"""The sparsifiers' density warm-up: DGC's exponential schedule, and payload sizes that follow the step."""

from __future__ import annotations

import math

import pytest
import torch

import commpress
from commpress.compressors._util import num_keep, warmup_ratio


def test_schedule_falls_in_stages_of_at_most_4x_from_start_to_ratio():
    # DGC's ImageNet schedule: 25%, 6.25%, 1.5625%, 0.4%, then 0.1%
    steps, start, ratio = 400, 0.25, 0.001
    values = [warmup_ratio(ratio, s, steps, start) for s in range(steps + 50)]
    assert values[0] == start and values[steps - 1] > ratio and values[steps:] == [ratio] * 50
    stages = sorted(set(values[:steps]), reverse=True)
    assert len(stages) == math.ceil(math.log(start / ratio, 4)) == 4
    assert all(a >= b for a, b in zip(values, values[1:]))                     # never grows
    seq = stages + [ratio]
    assert all(1.0 < a / b <= 4.0 + 1e-9 for a, b in zip(seq, seq[1:]))        # at most 4x per stage
    assert [values.index(v) for v in stages] == [0, 100, 200, 300]              # equal stage lengths
    # off: no steps, or a start at or below the target
    assert warmup_ratio(ratio, 0, 0, start) == ratio
    assert warmup_ratio(0.5, 0, 100, 0.25) == 0.5


@pytest.mark.parametrize("name", ["topk", "dgc", "randomk"])
def test_payload_size_follows_the_step(name):
    n = 20_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    c = commpress.get(name, ratio=0.01, density_warmup=6, density_start=0.25)
    off = commpress.get(name, ratio=0.01, density_warmup=0)
    sizes = []
    for step in range(8):
        p = c.compress_fixed(x, step=step, key="w")
        k = num_keep(c.ratio_at(step), n)
        sizes.append(p.tensors[-1].numel())
        expect = c.capacity(n, step) if c.aggregation == "sparse" else k
        assert sizes[-1] == expect
        y = c.decompress(p)
        assert y.shape == x.shape and bool(torch.isfinite(y).all())
    assert sizes[0] > sizes[2] > sizes[4] > sizes[6] == sizes[7]
    steady = off.compress_fixed(x, step=0, key="w").tensors[-1].numel()
    assert sizes[6] == steady and sizes[0] > 20 * steady
    if c.aggregation == "sparse":
        assert c.capacity(n) == off.capacity(n) == steady   # no step: the steady state


@pytest.mark.parametrize("name", ["topk", "dgc", "randomk"])
def test_a_bare_compressor_sends_its_ratio_at_every_step(name):
    # the warm-up is a training policy of the hooks: get(name, ratio=r) sends r from step 0 on
    n = 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    c = commpress.get(name, ratio=0.01)
    assert c.density_warmup == 0
    for step in (0, 1, 150):
        assert c.ratio_at(step) == 0.01
        sent = c.compress_fixed(x, step=step, key="w").tensors[-1].numel()
        assert sent == (c.capacity(n) if c.aggregation == "sparse" else num_keep(0.01, n))
    if name == "topk":   # exactly k = 1% of 1,000 entries, not the warm-up's 25%
        assert c.compress(x, step=0).tensors[0].numel() == 10


@pytest.mark.parametrize("name", ["topk", "dgc", "randomk"])
def test_the_hooks_ask_for_the_warmup_unless_given(name):
    from commpress.compressors._util import DEFAULT_DENSITY_WARMUP
    from commpress.hooks.common import resolve_compressor

    assert resolve_compressor(name, {"ratio": 0.01}).density_warmup == DEFAULT_DENSITY_WARMUP
    assert resolve_compressor(name, {"ratio": 0.01, "density_warmup": 3}).density_warmup == 3
    # an instance is the user's: taken as it is
    bare = commpress.get(name, ratio=0.01)
    assert resolve_compressor(bare).density_warmup == 0
    # a compressor without a warm-up gets nothing added
    assert resolve_compressor("blockquant", {"bits": 4}).config()["bits"] == 4


def test_bad_warmup_arguments_name_the_argument():
    with pytest.raises(ValueError, match="density_warmup"):
        commpress.get("topk", ratio=0.01, density_warmup=-1)
    with pytest.raises(ValueError, match="density_start"):
        commpress.get("dgc", ratio=0.01, density_start=1.5)
