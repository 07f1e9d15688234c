"""Contract of every compressor: round trip, wire size, payload layout, errors, non-finite input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from compressor_cases import CASES, DTYPES, IDS, build, dtypes, layouts, make, nbytes_bound, same, shapes
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import commpress

ALL_NAMES = {"identity", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd",
             "terngrad", "signsgd", "blockquant", "powersgd", "fp8", "mx"}
AGGREGATION = {"identity": "sum", "fp16": "sum", "bf16": "sum", "randomk": "sum",
               "topk": "sparse", "threshold": "sparse", "dgc": "sparse", "qsgd": "gather",
               "terngrad": "gather", "signsgd": "gather", "blockquant": "gather",
               "powersgd": "lowrank", "fp8": "gather", "mx": "gather"}


def test_registry_lists_every_compressor():
    assert ALL_NAMES <= set(commpress.available())
    for name in ALL_NAMES:
        params = next(p for n, p in CASES if n == name)
        assert make(name, params).aggregation == AGGREGATION[name]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@settings(max_examples=25)
@given(shape=shapes, layout=layouts, dtype=dtypes, seed=st.integers(0, 2**16))
def test_round_trip_shape_dtype_and_wire_size(case, shape, layout, dtype, seed):
    c = make(*case)
    x = build(shape, dtype, layout, seed)
    g = torch.Generator().manual_seed(seed)
    payload = c.compress(x, step=seed % 5, key=("layer", seed % 3), generator=g)
    y = c.decompress(payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert payload.shape == x.shape and payload.dtype == x.dtype and payload.numel == x.numel()
    assert isinstance(payload.tensors, tuple)
    assert payload.nbytes == sum(t.numel() * t.element_size() for t in payload.tensors)
    bound, exact = nbytes_bound(c, x, payload)
    assert payload.nbytes == bound if exact else payload.nbytes <= bound
    assert torch.isfinite(y.float()).all()
    if c.aggregation == "sparse":
        idx, values = payload.tensors
        assert idx.dtype == torch.int32 and values.dtype == x.dtype
        assert idx.numel() == values.numel()
        if idx.numel():
            assert idx.min() >= 0 and idx.max() < x.numel()
            assert (idx[1:] > idx[:-1]).all()  # unique and ascending
            assert torch.equal(values, x.reshape(-1)[idx.long()])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_input_is_not_modified(case):
    c = make(*case)
    x = build((30, 20), torch.float32, "transposed", 1)
    before = x.clone()
    c.decompress(c.compress(x, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(x, before)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8])
def test_unsupported_dtype_raises_type_error(case, dtype):
    c = make(*case)
    with pytest.raises(TypeError, match=str(dtype)):
        c.compress(torch.zeros(10, dtype=dtype))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_non_tensor_raises_type_error(case):
    with pytest.raises(TypeError):
        make(*case).compress([1.0, 2.0])


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input_propagates(case, bad, dtype):
    c = make(*case)
    x = build((40, 50), torch.float32, "contiguous", 7)
    x[13, 17] = float(bad)
    y = c.decompress(c.compress(x.to(dtype), generator=torch.Generator().manual_seed(1)))
    assert not torch.isfinite(y.float()).all()


@pytest.mark.parametrize("name,params,arg", [
    ("topk", {"ratio": 0.0}, "ratio"),
    ("topk", {"ratio": 1.5}, "ratio"),
    ("topk", {"ratio": -0.1}, "ratio"),
    ("topk", {"ratio": float("nan")}, "ratio"),
    ("topk", {"ratio": "0.1"}, "ratio"),
    ("randomk", {"ratio": 0.0}, "ratio"),
    ("randomk", {"ratio": 0.1, "seed": -1}, "seed"),
    ("dgc", {"ratio": 2.0}, "ratio"),
    ("dgc", {"ratio": 0.1, "sample_ratio": 0.0}, "sample_ratio"),
    ("threshold", {"threshold": -1.0}, "threshold"),
    ("threshold", {"threshold": float("nan")}, "threshold"),
    ("qsgd", {"levels": 0}, "levels"),
    ("qsgd", {"levels": 128}, "levels"),
    ("qsgd", {"levels": 2.5}, "levels"),
    ("qsgd", {"bucket": 0}, "bucket"),
    ("signsgd", {"chunk": 0}, "chunk"),
    ("blockquant", {"bits": 3}, "bits"),
    ("blockquant", {"bits": 16}, "bits"),
    ("blockquant", {"block": 0}, "block"),
    ("blockquant", {"stochastic": "yes"}, "stochastic"),
    ("powersgd", {"rank": 0}, "rank"),
    ("fp8", {"format": "e3m4"}, "format"),
    ("fp8", {"block": 0}, "block"),
    ("fp8", {"stochastic": 1}, "stochastic"),
    ("mx", {"element": "fp6_e3m2"}, "element"),
    ("mx", {"element": "int8"}, "element"),
    ("mx", {"stochastic": "no"}, "stochastic"),
    ("powersgd", {"rank": True}, "rank"),
    ("sparseloco", {"ratio": 0.0}, "ratio"),
    ("sparseloco", {"chunk": 0}, "chunk"),
    ("sparseloco", {"bits": 3}, "bits"),
])
def test_bad_parameters_raise_value_error_naming_the_argument(name, params, arg):
    with pytest.raises(ValueError, match=arg):
        commpress.get(name, **params)


def test_registry_errors():
    with pytest.raises(ValueError, match="topk"):  # lists the available names
        commpress.get("nope")
    with pytest.raises(ValueError, match="ratio"):  # lists the allowed parameters
        commpress.get("topk", ratio=0.1, level=3)
    with pytest.raises(ValueError, match="ratio"):
        commpress.get("topk")


def test_defaults_and_config():
    assert commpress.get("blockquant").config() == {"bits": 8, "block": 256, "stochastic": False}
    assert commpress.get("dgc", ratio=0.1).config() == {"ratio": 0.1, "sample_ratio": 0.01, "density_warmup": 0,
                                                        "density_start": 0.25}
    for name in ("qsgd", "terngrad", "signsgd", "powersgd"):
        commpress.get(name)  # every parameter has a default
    assert commpress.get("randomk", ratio=0.5).config()["seed"] == 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_generator_seed_gives_same_payload(case):
    c = make(*case)
    x = build((33, 17), torch.float32, "contiguous", 3)
    a = c.compress(x, step=2, key="k", generator=torch.Generator().manual_seed(5))
    b = make(*case).compress(x, step=2, key="k", generator=torch.Generator().manual_seed(5))
    assert all(same(s, t) for s, t in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("terngrad", {}),
                                         ("blockquant", {"stochastic": True, "bits": 2}),
                                         ("fp8", {"stochastic": True}),
                                         ("mx", {"element": "fp4_e2m1", "stochastic": True})])
def test_stochastic_rounding_depends_on_generator(name, params):
    c = commpress.get(name, **params)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a = c.compress(x, generator=torch.Generator().manual_seed(1))
    b = c.compress(x, generator=torch.Generator().manual_seed(2))
    assert not same(a.tensors[0], b.tensors[0])


def test_four_bit_blockquant_bound():
    x = torch.randn(1001)
    p = commpress.get("blockquant", bits=4, block=64).compress(x)
    assert p.nbytes <= math.ceil(1001 / 2) + 4 * math.ceil(1001 / 64)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decompress_into_out_reuses_the_buffer(case, dtype):
    c = make(*case)
    x = build((30, 20), dtype, "transposed", 2)
    payload = c.compress(x, generator=torch.Generator().manual_seed(0))
    want = c.decompress(payload)
    for out in (torch.full((30, 20), 7.0, dtype=dtype), torch.full((600,), 7.0, dtype=dtype)):
        got = c.decompress(payload, out=out)
        assert got.shape == x.shape and got.data_ptr() == out.data_ptr()
        assert got is out or out.shape != x.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES[:1] + [c for c in CASES if c[0] in ("topk", "fp8", "mx", "qsgd")],
                         ids=lambda c: c[0] if isinstance(c, str) else None)
def test_decompress_rejects_a_wrong_out(case):
    c = make(*case)
    payload = c.compress(torch.randn(40), generator=torch.Generator().manual_seed(0))
    for bad in (torch.empty(41), torch.empty(40, dtype=torch.float16), torch.empty(80)[::2]):
        with pytest.raises(ValueError, match="out"):
            c.decompress(payload, out=bad)


def _f32(v: float) -> float:
    return float(np.float32(v))


#: Finite fp32 at the extremes: magnitudes up to 3e38, whose squares and sums overflow, subnormals
#: down to 1e-45, whose squares underflow, and the two mixed in one tensor.
EXTREME = st.one_of(
    st.floats(_f32(1e19), _f32(3e38), width=32),
    st.floats(-_f32(3e38), -_f32(1e19), width=32),
    st.floats(-_f32(1e-36), _f32(1e-36), width=32),
    st.floats(-_f32(3e38), _f32(3e38), width=32),
    st.sampled_from([_f32(3e38), -_f32(3e38), _f32(1.5e30), 1e-45, -1e-45, 0.0, -0.0, 1.0]),
)


def test_every_registered_compressor_has_a_case():
    assert {name for name, _ in CASES} == set(commpress.available())


@pytest.mark.parametrize("case", CASES, ids=IDS)
@settings(max_examples=20)
@given(shape=st.one_of(st.tuples(st.integers(0, 70)), st.tuples(st.integers(2, 12), st.integers(2, 40))),
       data=st.data())
def test_extreme_finite_input_under_error_feedback(case, shape, data):
    """Under ErrorFeedback, finite input at fp32's extremes decodes finite and leaves a finite
    residual: nothing squares or sums a value before scaling it (qsgd's norms, signsgd's means),
    casts and products saturate instead of overflowing (fp16, randomk's numel/k, sparseloco's
    bins).  A second step adds the residual (``x + r`` may overflow: then the step is non-finite,
    its payload says so and the residual keeps its value).  PowerSGD's factors are sums over a
    row or a column, which no fp32 factor may hold at these magnitudes: its payload may come out
    non-finite, but then it is flagged and the residual stays finite."""
    n = math.prod(shape)
    x = torch.from_numpy(data.draw(hnp.arrays(np.float32, n, elements=EXTREME))).reshape(shape)
    ef = commpress.ErrorFeedback(make(*case))
    lowrank = ef.compressor.aggregation == "lowrank"
    for step in range(2):
        payload = ef.compress_fixed(x, step=step, key="k", generator=torch.Generator().manual_seed(step))
        y = ef.decompress(payload)
        residual = ef.residual("k")
        assert residual is None or bool(torch.isfinite(residual).all()), f"step {step}: residual"
        flagged = payload.nonfinite is not None and bool(payload.nonfinite)
        if step == 0 and not lowrank:
            assert bool(torch.isfinite(y).all()), "decode"
        else:
            assert bool(torch.isfinite(y).all()) or flagged, f"step {step}: an unflagged non-finite decode"
