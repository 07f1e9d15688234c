"""commpress.testing.check_compressor: every built-in and a user-written compressor pass it, and
it catches compressors that break the contract, naming the broken property and the input."""

from __future__ import annotations

import sys

import pytest
import torch
from compressor_cases import CASES, IDS, make

import commpress
from commpress.compressors import Compressor, Payload, register
from commpress.compressors.base import _REGISTRY
from commpress.testing import (CHECKS, check_aggregation, check_compressor, check_deterministic,
                               check_error_feedback, check_round_trip, check_state_dict,
                               check_unbiased, check_wire_size)

EXAMPLES = 8   # per shape check and compressor: the fixed odd inputs run on top of these


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_builtin_compressor_passes(case):
    check_compressor(make(*case), examples=EXAMPLES)


def test_every_registered_compressor_is_checked():
    assert {name for name, _ in CASES} == set(commpress.available())


# ------------------------------------------------------------------ user-written compressors
class ScaledSign(Compressor):
    """1 bit per entry and the mean |x|: biased, deterministic."""

    aggregation = "gather"
    unbiased = False

    def __init__(self, floor: float = 0.0) -> None:
        self.floor = floor

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        flat = tensor.reshape(-1).float()
        scale = flat.abs().mean().reshape(1) if flat.numel() else torch.zeros(1)
        return self.make_payload(tensor, (torch.signbit(flat), scale + self.floor))

    def decompress(self, payload, out=None):
        self.decode_target(payload, out)
        signs, scale = payload.tensors
        return self.finish_decode(payload, (1.0 - 2.0 * signs.float()) * scale, out)


def _plain_decompress(self, payload):
    """A decompress without ``out`` that returns a flat fp32 tensor: register() adds ``out=``,
    the reshape and the cast."""
    signs, scale = payload.tensors
    return (1.0 - 2.0 * signs.float()) * scale


@pytest.fixture
def scaled_sign():
    """ScaledSign registered as "test_scaled_sign" for the test, then unregistered."""
    cls = type("RegisteredScaledSign", (ScaledSign,), {"decompress": _plain_decompress})
    register("test_scaled_sign")(cls)
    try:
        yield commpress.get("test_scaled_sign", floor=0.0)
    finally:
        _REGISTRY.pop("test_scaled_sign", None)


def test_a_registered_user_compressor_passes(scaled_sign):
    check_compressor(scaled_sign, examples=EXAMPLES)


class EveryOther(Compressor):
    """Keeps every other entry (the even positions at even steps, the odd ones at odd steps): a
    plain subclass (not registered), aggregation "sparse"; compress_fixed pads to ceil(numel/2)."""

    aggregation = "sparse"
    unbiased = False

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        flat = tensor.reshape(-1)
        idx = torch.arange(min(step % 2, flat.numel()), flat.numel(), 2, dtype=torch.int32)
        return self.make_payload(tensor, (idx, flat[idx.long()].clone()))

    def compress_fixed(self, tensor, *, step=0, key=0, generator=None):
        p = self.compress(tensor, step=step)
        idx, values = p.tensors
        pad = (tensor.numel() + 1) // 2 - idx.numel()
        idx = torch.cat([idx, torch.full((pad,), tensor.numel(), dtype=torch.int32)])
        values = torch.cat([values, values.new_zeros(pad)])
        return self.make_payload(tensor, (idx, values))

    def decompress(self, payload, out=None):
        self.decode_target(payload, out)
        idx, values = payload.tensors
        dense = torch.zeros(payload.numel + 1, dtype=torch.float32)   # slot numel: padding
        dense[idx.long()] = values.float()
        return self.finish_decode(payload, dense[:-1], out)


def test_a_plain_subclass_passes():
    check_compressor(EveryOther(), examples=EXAMPLES)


def test_a_factory_passes_and_the_compressor_is_left_untouched():
    c = commpress.get("powersgd", rank=1)
    check_compressor(lambda: commpress.get("powersgd", rank=1), examples=2)
    check_compressor(c, examples=2)
    assert c.state_dict()["warm_start"]["keys"] == []   # the checks ran on fresh instances


# ------------------------------------------------------------------ broken compressors are caught
class CoarseRound(Compressor):
    """Rounds to a grid of 0.5 (deterministic) but claims to be unbiased."""

    aggregation = "gather"
    unbiased = True

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        return self.make_payload(tensor, (torch.round(tensor.reshape(-1).float() * 2).to(torch.int8),))

    def decompress(self, payload, out=None):
        self.decode_target(payload, out)
        return self.finish_decode(payload, payload.tensors[0].float() / 2, out)


class SkewedRounding(Compressor):
    """Stochastic rounding to a grid of 0.5 that rounds up with probability
    ``f + f*(1-f)/2`` instead of ``f`` (``f`` the fraction): random, biased by up to 1/16 per
    entry, too little to show in one entry's mean over the samples (the check's projection
    on the entries together catches it)."""

    aggregation = "gather"
    unbiased = True
    deterministic = False

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        x = tensor.reshape(-1).float() * 2
        low = torch.floor(x)
        g = torch.Generator().manual_seed(generator) if isinstance(generator, int) else generator
        f = x - low
        up = torch.rand(x.shape, generator=g) < f + f * (1 - f) / 2
        return self.make_payload(tensor, ((low + up.float()).to(torch.int8),))

    def decompress(self, payload, out=None):
        self.decode_target(payload, out)
        return self.finish_decode(payload, payload.tensors[0].float() / 2, out)


class FlatDecode(EveryOther):
    """Decompresses to a flat tensor whatever the input's shape."""

    def decompress(self, payload, out=None):
        return super().decompress(payload).reshape(-1)


class _LyingPayload(Payload):
    @property
    def nbytes(self) -> int:
        return max(1, super().nbytes // 4)   # claims 4x less than it sends


class LyingSize(ScaledSign):
    def compress(self, tensor, *, step=0, key=0, generator=None):
        p = super().compress(tensor)
        return _LyingPayload(p.tensors, p.shape, p.dtype, p.numel, p.meta)


class SecretlyRandom(Compressor):
    """Stochastic rounding from torch's global generator while claiming to be deterministic."""

    aggregation = "gather"
    unbiased = True
    deterministic = True

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        x = tensor.reshape(-1).float() * 4
        low = torch.floor(x)
        up = torch.rand(x.shape) < (x - low)
        return self.make_payload(tensor, ((low + up.float()).to(torch.int16),))

    def decompress(self, payload, out=None):
        self.decode_target(payload, out)
        return self.finish_decode(payload, payload.tensors[0].float() / 4, out)


class ForgetfulCounter(ScaledSign):
    """Its payload depends on a call counter that state_dict() does not save."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def compress(self, tensor, *, step=0, key=0, generator=None):
        p = super().compress(tensor)
        self.calls += 1
        signs, scale = p.tensors
        return self.make_payload(tensor, (signs, scale * (1 + 0.01 * (self.calls % 2))))


class SendsNothing(ScaledSign):
    """Biased and useless: always decodes to zero, so error feedback never gets anywhere."""

    def compress(self, tensor, *, step=0, key=0, generator=None):
        p = super().compress(tensor)
        return self.make_payload(tensor, (p.tensors[0], torch.zeros(1)))


class DataSizedSparse(EveryOther):
    """Keeps the entries with |x| > 1 and does not pad compress_fixed to a capacity."""

    compress_fixed = Compressor.compress_fixed

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        flat = tensor.reshape(-1)
        idx = torch.nonzero(flat.float().abs() > 1).reshape(-1).to(torch.int32)
        return self.make_payload(tensor, (idx, flat[idx.long()].clone()))


class RepeatedIndices(EveryOther):
    compress_fixed = Compressor.compress_fixed

    def compress(self, tensor, *, step=0, key=0, generator=None):
        p = super().compress(tensor, step=step)
        idx, values = p.tensors
        return self.make_payload(tensor, (torch.cat([idx, idx]), torch.cat([values, values])))


class SquareSum(Compressor):
    """Claims "sum" aggregation but sends x**2 (with signs): payloads do not add."""

    aggregation = "sum"

    def compress(self, tensor, *, step=0, key=0, generator=None):
        self.check_input(tensor)
        x = tensor.reshape(-1).float()
        return self.make_payload(tensor, (x * x.abs(),))

    def decompress(self, payload, out=None):
        self.decode_target(payload, out)
        y = payload.tensors[0]
        return self.finish_decode(payload, y.sign() * y.abs().sqrt(), out)


@pytest.mark.parametrize("compressor,check,prop", [
    (CoarseRound(), check_unbiased, "unbiased"),
    (SkewedRounding(), check_unbiased, "unbiased"),
    (FlatDecode(), check_round_trip, "round trip"),
    (LyingSize(), check_wire_size, "wire size"),
    (SecretlyRandom(), check_deterministic, "determinism"),
    (ForgetfulCounter(), check_state_dict, "state_dict"),
    (SendsNothing(), check_error_feedback, "error feedback"),
    (DataSizedSparse(), check_wire_size, "wire size"),
    (RepeatedIndices(), check_aggregation, 'aggregation "sparse"'),
    (SquareSum(), check_aggregation, 'aggregation "sum"'),
], ids=lambda v: type(v).__name__ if isinstance(v, Compressor) else None)
def test_a_broken_property_is_caught_and_named(compressor, check, prop):
    with pytest.raises(AssertionError) as info:
        check_compressor(compressor, examples=EXAMPLES)
    message = str(info.value)
    assert message.startswith(prop), message
    assert type(compressor).__name__ in message
    # the failing input is named
    for part in ("shape", "dtype", "seed"):
        assert part in message, message
    # and the single check raises the same
    with pytest.raises(AssertionError, match=f"^{prop}"):
        check(compressor) if check in (check_unbiased, check_error_feedback, check_state_dict) \
            else check(compressor, examples=EXAMPLES)


def test_the_failing_input_is_shrunk():
    """A compressor that breaks only from 200 entries on: hypothesis finds the failure (the odd
    inputs are all smaller) and shrinks it towards the smallest such input, which the message names."""

    class BreaksWhenLarge(EveryOther):
        def decompress(self, payload, out=None):
            y = super().decompress(payload)
            return y.reshape(-1) if payload.numel >= 200 else y

    with pytest.raises(AssertionError, match=r"^round trip.*input shape \(") as info:
        check_round_trip(BreaksWhenLarge(), examples=30)
    shape = eval(str(info.value).split("input shape ")[1].split(", dtype")[0])
    numel = 1
    for n in shape:
        numel *= n
    assert len(shape) >= 2 and 200 <= numel <= 250, shape


def test_the_same_seed_runs_the_same_examples():
    """Deterministic: the same failure (input and message) on every run with the same seed."""
    messages = []
    for _ in range(2):
        with pytest.raises(AssertionError) as info:
            check_deterministic(SecretlyRandom(), seed=3, examples=EXAMPLES)
        messages.append(str(info.value).split("[")[-1])
    assert messages[0] == messages[1]


def test_unknown_check_names_the_allowed_ones():
    with pytest.raises(ValueError, match="round_trip"):
        check_compressor(ScaledSign(), checks=("nope",))
    assert set(CHECKS) == {"round_trip", "wire_size", "deterministic", "unbiased", "error_feedback",
                           "state_dict", "aggregation"}


def test_not_a_compressor_raises_type_error():
    with pytest.raises(TypeError, match="Compressor"):
        check_compressor(3)


def test_missing_hypothesis_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)   # makes `import hypothesis` fail
    with pytest.raises(ImportError, match="pip install hypothesis"):
        check_compressor(ScaledSign())


def test_a_small_bias_summed_over_the_entries_is_caught():
    """SkewedRounding's bias hides in each entry's noise at seed 1; the projection finds it."""
    with pytest.raises(AssertionError, match="^unbiased.*projected on the mean error"):
        check_unbiased(SkewedRounding(), seed=1)
