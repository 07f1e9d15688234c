"""topk's NaN/inf verdict read from its k selected values (issue 17) equals the full-pass verdict,
and the payload and residual are bitwise those of the path that scans the whole tensor."""

from __future__ import annotations

import pytest
import torch

import commpress
from commpress.compressors.topk import TopK


class ScanningTopK(TopK):
    """TopK that does not claim to keep NaN/inf and has no fused error feedback: error
    feedback compensates into a buffer, then selects, and scans the whole tensor."""

    keeps_nonfinite = False
    fused_feedback = False


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
def test_verdict_from_values_matches_the_full_scan(poison):
    g = torch.Generator().manual_seed(3)
    fast = commpress.ErrorFeedback(TopK(0.01))
    slow = commpress.ErrorFeedback(ScanningTopK(0.01))
    for step in range(3):
        x = torch.randn(5000, generator=g)
        if poison is not None and step == 1:
            x[1234] = poison
        a = fast.compress_fixed(x, step=step, key="k")
        b = slow.compress_fixed(x, step=step, key="k")
        assert bool(a.nonfinite) == bool(b.nonfinite) == (poison is not None and step == 1)
        for ta, tb in zip(a.tensors, b.tensors):
            assert torch.equal(ta.view(torch.int32), tb.view(torch.int32))
        assert torch.equal(fast.residual("k").view(torch.int32), slow.residual("k").view(torch.int32))


@pytest.mark.parametrize("value,bad", [(float("nan"), True), (float("inf"), True), (-float("inf"), True),
                                       (3e38, False), (-0.0, False)])
def test_the_exact_verdict_reads_every_element_and_only_nan_or_inf(value, bad):
    """``exact_nonfinite_flag``: NaN/inf anywhere (first, middle, last) reads bad; huge finite values
    whose sum overflows fp32 read finite (the sum-based ``nonfinite_flag`` reads them bad)."""
    from commpress.feedback import exact_nonfinite_flag, nonfinite_flag

    for at in (0, 500, 999):
        t = torch.full((1000,), 3e38 if value == 3e38 else 1.0)
        t[at] = value
        flag = exact_nonfinite_flag(t)
        assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag) is bad
    if value == 3e38:
        assert bool(nonfinite_flag(t)) and not bool(exact_nonfinite_flag(t))
    assert not bool(exact_nonfinite_flag(torch.empty(0)))
