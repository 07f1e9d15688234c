"""Property tests of the compressor contract, for users who write their own compressor.

:func:`check_compressor` runs every check below on one compressor; each check is also a
function of its own (``check_round_trip``, ``check_wire_size``, ``check_deterministic``,
``check_unbiased``, ``check_error_feedback``, ``check_state_dict``, ``check_aggregation``), so a
user can run one.  A broken property raises :class:`AssertionError` whose message starts with
the property's name and names the (minimal) failing input: shape, dtype, layout and seed.

The shape-and-dtype properties are driven by `hypothesis <https://hypothesis.readthedocs.io>`_
(``derandomize=True``, no deadline, no example database: the same examples on every run),
after a fixed set of odd inputs (empty, one element, non-contiguous, 3-D) for every dtype in
``compressor.supported_dtypes``; a failure is shrunk to a minimal input.  The statistical checks
(unbiasedness, error feedback) use fixed seeds.  hypothesis is a test extra
(``pip install hypothesis``); it is imported only when a check runs.  The inputs are CPU
tensors; torch's global generator is seeded inside each check (and restored after), so even a
compressor that draws from it fails the same way on every run.

Example::

    import torch
    import commpress
    from commpress.compressors import Compressor, register
    from commpress.testing import check_compressor

    @register("scaled_sign")
    class ScaledSign(Compressor):
        aggregation = "gather"
        unbiased = False

        def compress(self, tensor, *, step=0, key=0, generator=None):
            self.check_input(tensor)
            flat = tensor.reshape(-1).float()
            scale = flat.abs().mean().reshape(1) if flat.numel() else torch.zeros(1)
            return self.make_payload(tensor, (torch.signbit(flat), scale))

        def decompress(self, payload):
            signs, scale = payload.tensors
            return (1.0 - 2.0 * signs.float()) * scale   # register() reshapes and casts

    check_compressor(commpress.get("scaled_sign"))    # raises AssertionError if broken
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
from typing import Any, Callable, Iterator, Union

import torch

from .compressors.base import _REGISTRY, Compressor, Payload

__all__ = [
    "check_compressor", "check_round_trip", "check_wire_size", "check_deterministic",
    "check_unbiased", "check_error_feedback", "check_state_dict", "check_aggregation", "make_tensor",
]

#: A compressor, or a callable with no arguments that builds a fresh one.
CompressorLike = Union[Compressor, Callable[[], Compressor]]

DEFAULT_EXAMPLES = 20

#: Odd inputs every shape check runs first, for every supported dtype: (shape, layout).
ODD_INPUTS = (
    ((0,), "contiguous"),          # empty
    ((3, 0, 2), "contiguous"),     # empty, 3-D
    ((), "contiguous"),            # one element, 0-d
    ((1,), "contiguous"),          # one element
    ((1,), "strided"),             # one element, stride 2
    ((9, 13), "transposed"),       # non-contiguous
    ((6, 5), "strided"),           # non-contiguous (every 2nd row)
    ((3, 4, 5), "transposed"),     # 3-D, non-contiguous
)


# ---------------------------------------------------------------------------- helpers
def _hypothesis():
    try:
        import hypothesis
        from hypothesis import strategies
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "commpress.testing needs hypothesis (a test extra): pip install hypothesis") from exc
    return hypothesis, strategies


def _factory(compressor: CompressorLike) -> Callable[[], Compressor]:
    """A callable that builds fresh instances configured like ``compressor``.

    A callable is used as it is.  A compressor registered with
    :func:`commpress.compressors.register` is rebuilt from its recorded configuration; any other
    is deep-copied (from a copy taken now, before the checks use it)."""
    if not isinstance(compressor, Compressor):
        if not callable(compressor):
            raise TypeError(f"compressor must be a Compressor or a callable that builds one, "
                            f"got {type(compressor).__name__}")

        def build() -> Compressor:
            c = compressor()
            if not isinstance(c, Compressor):
                raise TypeError(f"the compressor factory returned {type(c).__name__}, not a Compressor")
            return c
        return build
    cls = type(compressor)
    config = getattr(compressor, "_config", None)
    if config is not None and _REGISTRY.get(cls.name) is cls:
        try:
            fresh = cls(**config)
        except Exception:  # a signature with *args/**kwargs: fall back to a copy
            fresh = None
        if fresh is not None:
            return lambda: cls(**config)
    snapshot = copy.deepcopy(compressor)
    return lambda: copy.deepcopy(snapshot)


def make_tensor(shape, dtype: torch.dtype, layout: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A standard-normal tensor of ``shape`` and ``dtype`` drawn from ``seed`` (times ``scale``),
    laid out ``"contiguous"``, ``"transposed"`` or ``"strided"`` (every 2nd row): the checks'
    inputs, for a user's own tests too."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        base = torch.randn(shape[::-1], generator=g) * scale
        return base.to(dtype).permute(*reversed(range(len(shape))))
    if layout == "strided" and len(shape) >= 1:
        base = torch.randn((2 * shape[0],) + shape[1:], generator=g) * scale
        return base.to(dtype)[::2]
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's global generator seeded with ``seed`` inside, restored after: a compressor that
    (wrongly) draws from it fails the same way on every run, and the caller's stream is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _with_seeded_rng(check: Callable[..., None]) -> Callable[..., None]:
    """Run ``check`` with torch's global generator seeded from its ``seed`` (see :func:`_seeded`)."""
    @functools.wraps(check)
    def wrapper(compressor: CompressorLike, *, seed: int = 0, **kwargs: Any) -> None:
        with _seeded(seed):
            check(compressor, seed=seed, **kwargs)
    return wrapper


def _sample_seed(seed: int, i: int) -> int:
    """The ``i``-th call's generator seed: splitmix64 of ``(seed, i)``, so the calls' seeds share
    no bit pattern (the counter-based noise of the built-ins hashes ``element ^ seed``: seeds
    that differ in a few low bits only permute the same noise among the elements)."""
    z = (seed * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def _where(shape, dtype, layout, seed) -> str:
    return f"input shape {tuple(shape)}, dtype {dtype}, layout {layout}, seed {seed}"


def _fail(prop: str, compressor: Any, detail: str, where: str = "") -> AssertionError:
    return AssertionError(f"{prop} ({compressor!r}): {detail}" + (f" [{where}]" if where else ""))


def _call(prop: str, c: Compressor, where: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception becomes an AssertionError naming ``prop``."""
    try:
        return fn(*args, **kwargs)
    except AssertionError:
        raise
    except Exception as exc:
        raise _fail(prop, c, f"{getattr(fn, '__name__', fn)} raised {type(exc).__name__}: {exc}",
                    where) from exc


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (so float8, NaN and -0.0 compare exactly)."""
    t = t.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.view(torch.uint8) if t.element_size() > 0 and t.dtype != torch.bool else t


def _same_payload(a: Payload, b: Payload) -> str | None:
    """``None`` when the wire tensors are identical, else what differs."""
    if len(a.tensors) != len(b.tensors):
        return f"{len(a.tensors)} vs {len(b.tensors)} wire tensors"
    for i, (s, t) in enumerate(zip(a.tensors, b.tensors)):
        if s.dtype != t.dtype or s.shape != t.shape:
            return f"wire tensor {i}: {s.dtype} {tuple(s.shape)} vs {t.dtype} {tuple(t.shape)}"
        if not torch.equal(_bytes(s), _bytes(t)):
            return f"wire tensor {i} differs"
    return None


def _dtypes(c: Compressor) -> tuple[torch.dtype, ...]:
    dtypes = tuple(getattr(c, "supported_dtypes", ()) or ())
    if not dtypes:
        raise _fail("supported_dtypes", c, "is empty")
    return dtypes


def _main_dtype(c: Compressor) -> torch.dtype:
    dtypes = _dtypes(c)
    return torch.float32 if torch.float32 in dtypes else dtypes[0]


def _property(prop: str, c: Compressor, body: Callable[[tuple, torch.dtype, str, int], None], *,
              seed: int, examples: int, odd: bool = True) -> None:
    """Run ``body(shape, dtype, layout, seed)`` on the odd inputs, then on ``examples`` drawn by
    hypothesis (derandomized; a failure is shrunk and re-raised as an AssertionError)."""
    hypothesis, st = _hypothesis()
    dtypes = _dtypes(c)
    shapes = st.one_of(
        st.just(()),
        st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
        st.tuples(st.integers(8, 40), st.integers(8, 40)),
    )

    def run(shape, dtype, layout, s):
        try:
            with _seeded(seed + s):
                body(shape, dtype, layout, seed + s)
        except AssertionError:
            raise
        except Exception as exc:
            raise _fail(prop, c, f"{type(exc).__name__}: {exc}", _where(shape, dtype, layout, seed + s)) from exc

    if odd:
        for dtype in dtypes:
            for shape, layout in ODD_INPUTS:
                run(shape, dtype, layout, 0)
    if examples <= 0:
        return
    test = hypothesis.given(shape=shapes, dtype=st.sampled_from(dtypes),
                            layout=st.sampled_from(["contiguous", "transposed", "strided"]),
                            s=st.integers(0, 2**16))(run)
    test = hypothesis.settings(
        max_examples=examples, derandomize=True, deadline=None, database=None,
        report_multiple_bugs=False, print_blob=False,
        suppress_health_check=list(hypothesis.HealthCheck))(test)
    try:
        test()
    except AssertionError:
        raise
    except hypothesis.errors.HypothesisException as exc:  # Flaky: the failure did not replay
        raise _fail(prop, c, f"the failure did not reproduce ({type(exc).__name__}: {exc}): "
                    "is it deterministic for a fixed seed?") from exc


# ---------------------------------------------------------------------------- the checks
def check_round_trip(compressor: CompressorLike, *, seed: int = 0, examples: int = DEFAULT_EXAMPLES) -> None:
    """``decompress(compress(x))`` keeps ``x``'s shape and dtype, leaves ``x`` as it was, and
    decodes a finite ``x`` to finite values; the payload records ``x``'s shape, dtype and numel.
    Both ``compress`` and ``compress_fixed``, for every dtype in ``supported_dtypes``, odd shapes
    (empty, one element, non-contiguous, 3-D) and ``examples`` drawn ones.

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one.
        seed: offset of every input's seed.
        examples: inputs drawn by hypothesis after the odd ones.

    Raises:
        AssertionError: ``round trip`` and the failing input.
        ImportError: hypothesis is not installed.

    Example:
        >>> check_round_trip(commpress.get("topk", ratio=0.1))
    """
    fresh = _factory(compressor)
    c = fresh()
    prop = "round trip"

    def body(shape, dtype, layout, s):
        where = _where(shape, dtype, layout, s)
        x = make_tensor(shape, dtype, layout, s)
        before = x.clone()
        for name in ("compress", "compress_fixed"):
            p = _call(prop, c, where, getattr(c, name), x, step=s % 5, key=("layer", s % 3), generator=s)
            if not isinstance(p, Payload):
                raise _fail(prop, c, f"{name} returned {type(p).__name__}, not a Payload", where)
            if not isinstance(p.tensors, tuple) or not all(isinstance(t, torch.Tensor) for t in p.tensors):
                raise _fail(prop, c, f"{name}: payload.tensors must be a tuple of tensors", where)
            if tuple(p.shape) != tuple(x.shape) or p.dtype != x.dtype or p.numel != x.numel():
                raise _fail(prop, c, f"{name}: payload says shape {tuple(p.shape)}, dtype {p.dtype}, "
                            f"numel {p.numel}", where)
            y = _call(prop, c, where, c.decompress, p)
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(x.shape) or y.dtype != x.dtype:
                got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
                raise _fail(prop, c, f"decompress({name}) returned {got}, expected {x.dtype} "
                            f"{tuple(x.shape)}", where)
            if not bool(torch.isfinite(y.float()).all()):
                raise _fail(prop, c, f"decompress({name}) of a finite input is not finite", where)
            if not torch.equal(_bytes(x), _bytes(before)):
                raise _fail(prop, c, f"{name} modified its input", where)

    _property(prop, c, body, seed=seed, examples=examples)


def check_wire_size(compressor: CompressorLike, *, seed: int = 0, examples: int = DEFAULT_EXAMPLES) -> None:
    """``payload.nbytes`` is the sum of the wire tensors' bytes, and the wire of
    ``compress_fixed`` depends only on ``(numel, dtype)``: two different inputs of the same shape
    (one of them scaled by 100 with half its entries zero) give the same wire tensors' dtypes and
    sizes.

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one.
        seed: offset of every input's seed.
        examples: inputs drawn by hypothesis after the odd ones.

    Raises:
        AssertionError: ``wire size`` and the failing input.
        ImportError: hypothesis is not installed.

    Example:
        >>> check_wire_size(commpress.get("threshold", threshold=0.5))
    """
    fresh = _factory(compressor)
    prop = "wire size"
    c = fresh()

    def body(shape, dtype, layout, s):
        where = _where(shape, dtype, layout, s)
        x = make_tensor(shape, dtype, layout, s)
        other = make_tensor(shape, torch.float32, layout, s + 1, scale=100.0)
        other = other * (torch.arange(other.numel()).reshape(other.shape) % 2)
        other = other.to(dtype)
        sizes = []
        for name, inp in (("compress", x), ("compress_fixed", x), ("compress_fixed", other)):
            p = _call(prop, c, where, getattr(c, name), inp, step=1, key="wire", generator=s)
            wire = sum(t.numel() * t.element_size() for t in p.tensors)
            if p.nbytes != wire:
                raise _fail(prop, c, f"{name}: payload.nbytes is {p.nbytes}, the wire tensors hold "
                            f"{wire} bytes", where)
            sizes.append(tuple((t.dtype, tuple(t.shape)) for t in p.tensors))
        if sizes[1] != sizes[2]:
            raise _fail(prop, c, f"compress_fixed's wire depends on the data: {sizes[1]} vs {sizes[2]} "
                        "for two inputs of the same shape and dtype", where)

    _property(prop, c, body, seed=seed, examples=examples)


def check_deterministic(compressor: CompressorLike, *, seed: int = 0, examples: int = DEFAULT_EXAMPLES) -> None:
    """Equal calls give equal payloads.  A ``deterministic`` compressor: two fresh instances given
    the same ``(tensor, step, key)`` (and different generators, which it must ignore) give the
    same wire tensors.  A stochastic one: the same ``generator`` seed (an int, or a
    ``torch.Generator`` seeded with it) gives the same wire tensors.

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one.
        seed: offset of every input's seed.
        examples: inputs drawn by hypothesis after the odd ones.

    Raises:
        AssertionError: ``determinism`` and the failing input.
        ImportError: hypothesis is not installed.

    Example:
        >>> check_deterministic(commpress.get("qsgd"))   # stochastic: same seed, same payload
    """
    fresh = _factory(compressor)
    prop = "determinism"
    c = fresh()
    deterministic = bool(c.deterministic)

    def body(shape, dtype, layout, s):
        where = _where(shape, dtype, layout, s)
        x = make_tensor(shape, dtype, layout, s)
        a, b = fresh(), fresh()
        if deterministic:
            gens = [(s, s + 1), (torch.Generator().manual_seed(s), torch.Generator().manual_seed(s + 7))]
        else:
            gens = [(s, s), (torch.Generator().manual_seed(s), torch.Generator().manual_seed(s))]
        for step, (ga, gb) in enumerate(gens):
            pa = _call(prop, a, where, a.compress, x, step=step, key="det", generator=ga)
            pb = _call(prop, b, where, b.compress, x, step=step, key="det", generator=gb)
            diff = _same_payload(pa, pb)
            if diff is not None:
                what = ("the same (tensor, step, key) gave different payloads (deterministic=True)"
                        if deterministic else
                        f"the same generator seed ({type(ga).__name__}) gave different payloads")
                raise _fail(prop, c, f"{what}: {diff}", where)

    _property(prop, c, body, seed=seed, examples=examples)


@_with_seeded_rng
def check_unbiased(compressor: CompressorLike, *, seed: int = 0, samples: int = 256,
                   shape: tuple[int, ...] = (16, 24), sigmas: float = 5.0, rtol: float = 2.0**-8) -> None:
    """For a compressor that declares ``unbiased``: the mean of ``decompress(compress(x))`` over
    ``samples`` calls (generator seed, step and key varied; fixed seeds) is, for every entry, within
    ``sigmas`` standard errors of ``x`` plus a rounding allowance of ``rtol * |x|`` (the default
    is bf16's rounding, so a deterministic cast to fp16/bf16 passes and a coarser grid does not).
    The standard error is estimated from the samples.  A rare outcome (probability ``p`` well
    below ``1/samples``, e.g. stochastic rounding of a tiny entry up a coarse level) may be hit by
    no sample, or by far fewer than its share, leaving a deviation of up to ``p * jump`` that the
    samples' variance does not show: each bound therefore also allows ``15 * D / samples``, where
    ``D`` is the largest spread (max - min over the samples) of any entry: the deviation of an
    outcome of that size missed with probability ``e**-15``, about that of 5 sigma.  A
    deterministic compressor has ``D = 0``: its bound is the rounding allowance alone.
    Then the entries together: the second half of the samples' errors, projected on the mean
    error of the first half (a direction fixed before the second half is read), must average 0
    within the same bounds, which catches a bias too small to show in any one entry.
    Nothing is checked when ``compressor.unbiased`` is False.

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one.
        seed: seed of the input and of the calls' generators.
        samples: calls averaged.
        shape: the input's shape (fp32 when supported).
        sigmas: the bound in standard errors.
        rtol: relative allowance for deterministic rounding.

    Raises:
        AssertionError: ``unbiased`` with the worst entry, its input value, mean and bound.

    Example:
        >>> check_unbiased(commpress.get("randomk", ratio=0.3))
    """
    fresh = _factory(compressor)
    prop = "unbiased"
    c = fresh()
    if not c.unbiased:
        return
    dtype = _main_dtype(c)
    x = make_tensor(shape, dtype, "contiguous", seed)
    where = _where(shape, dtype, "contiguous", seed)
    ys = []
    for i in range(samples):
        p = _call(prop, c, where, c.compress, x, step=i, key=("unbiased", i), generator=_sample_seed(seed, i))
        y = _call(prop, c, where, c.decompress, p)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(x.shape):
            raise _fail(prop, c, f"decompress returned {getattr(y, 'shape', type(y).__name__)}", where)
        ys.append(y.detach().cpu().double().reshape(-1))
    xd = x.double().reshape(-1)
    if not xd.numel():
        return
    err = torch.stack(ys) - xd                          # samples x numel, each entry's error
    allowance = rtol * xd.abs() + 1e-6 * xd.abs().max()  # deterministic rounding, per entry

    def bound(errors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(mean, sigmas standard errors, rare-outcome allowance) of the columns of ``errors``."""
        n = errors.shape[0]
        mean = errors.mean(0)
        se = errors.std(0, unbiased=True) / math.sqrt(n) if n > 1 else torch.zeros_like(mean)
        return mean, sigmas * se, 15.0 * float((errors.amax(0) - errors.amin(0)).max()) / n

    # every entry
    mean, sig, rare = bound(err)
    limit = sig + rare + allowance
    bad = mean.abs() > limit
    if bool(bad.any()):
        j = int(torch.argmax(mean.abs() - limit))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(j), x.shape)) if x.dim() else ()
        raise _fail(prop, c, f"the mean of decompress over {samples} seeds is {float(mean[j] + xd[j]):.6g} "
                    f"at entry {idx} where the input is {float(xd[j]):.6g} (bound {float(limit[j]):.3g}: "
                    f"{sigmas:g} standard errors = {float(sig[j]):.3g}, rare outcomes {rare:.3g}, "
                    f"rounding {rtol:g}*|x|); {int(bad.sum())} of {x.numel()} entries out of bounds", where)
    # all entries together: a bias too small to show in one entry adds up over many.  The mean
    # error of the first half of the samples is a direction fixed before the second half is
    # looked at; the second half's errors projected on it have mean 0 if unbiased, and about
    # |bias|^2 if not.
    half = samples // 2
    if half < 2:
        return
    direction = err[:half].mean(0)
    proj = err[half:] @ direction
    mean, sig, rare = bound(proj.reshape(-1, 1))
    limit = float(sig[0]) + rare + float((direction.abs() * allowance).sum())
    if abs(float(mean[0])) > limit:
        raise _fail(prop, c, f"the errors of decompress over {samples - half} seeds, projected on the "
                    f"mean error of {half} other seeds, average {float(mean[0]):.4g} (bound {limit:.3g}: "
                    f"{sigmas:g} standard errors = {float(sig[0]):.3g}, rare outcomes {rare:.3g}, rounding "
                    f"{rtol:g}*|x|): a bias summed over the entries", where)


@_with_seeded_rng
def check_error_feedback(compressor: CompressorLike, *, seed: int = 0, steps: int = 300, lr: float = 0.05,
                         shape: tuple[int, ...] = (16, 32), fraction: float = 0.01) -> None:
    """For a biased compressor (``unbiased`` False): gradient descent on
    ``f(x) = ||x - target||^2 / 2`` from ``x = 0``, with the gradient sent through
    ``commpress.ErrorFeedback(compressor)`` (``compress_fixed`` then ``decompress``), reaches
    ``f < fraction * f(0)`` within ``steps`` steps of learning rate ``lr``.  Nothing is checked
    when ``compressor.unbiased`` is True.

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one.
        seed: seed of the target and of the calls' generators.
        steps: gradient steps.
        lr: learning rate.  Error feedback holds an entry back until it is sent, so a
            sparsifier that sends an entry every ``tau`` steps on average needs ``lr * tau < 2``:
            the default suits a density down to about 5%; pass a smaller one for sparser ones.
        shape: the parameter's shape (fp32 when supported; 2-D so low-rank compressors compress).
        fraction: the loss to reach, as a fraction of the initial loss.

    Raises:
        AssertionError: ``error feedback`` with the initial and final loss.

    Example:
        >>> check_error_feedback(commpress.get("topk", ratio=0.1))
    """
    from .feedback import ErrorFeedback

    fresh = _factory(compressor)
    prop = "error feedback"
    c = fresh()
    if c.unbiased:
        return
    dtype = _main_dtype(c)
    where = _where(shape, dtype, "contiguous", seed)
    target = make_tensor(shape, torch.float32, "contiguous", seed)
    ef = _call(prop, c, where, ErrorFeedback, c)
    x = torch.zeros(shape, dtype=torch.float32)
    f0 = 0.5 * float((x - target).pow(2).sum())
    f = f0
    for t in range(steps):
        grad = (x - target).to(dtype)
        p = _call(prop, c, where, ef.compress_fixed, grad, step=t, key="ef", generator=_sample_seed(seed, t))
        sent = _call(prop, c, where, ef.decompress, p).float()
        x -= lr * sent.reshape(shape)
        f = 0.5 * float((x - target).pow(2).sum())
        if not math.isfinite(f):
            raise _fail(prop, c, f"the loss became {f} at step {t}", where)
        if f < fraction * f0:
            return
    raise _fail(prop, c, f"gradient descent on ||x - target||^2/2 with ErrorFeedback({c.name or type(c).__name__}) "
                f"reached loss {f:.4g} after {steps} steps (lr {lr}) from {f0:.4g}; expected below "
                f"{fraction:g} of it", where)


@_with_seeded_rng
def check_state_dict(compressor: CompressorLike, *, seed: int = 0, shape: tuple[int, ...] = (16, 32)) -> None:
    """``state_dict()`` after a few calls survives ``torch.save`` / ``torch.load(weights_only=True)``
    and, loaded into a fresh instance built the same way, reproduces the next payload.

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one (a
            registered compressor is rebuilt from its configuration; another is deep-copied
            from its state when the check starts).
        seed: seed of the inputs and generators.
        shape: the inputs' shape.

    Raises:
        AssertionError: ``state_dict`` and what failed.

    Example:
        >>> check_state_dict(commpress.get("powersgd", rank=2))
    """
    fresh = _factory(compressor)
    prop = "state_dict"
    a = fresh()
    dtype = _main_dtype(a)
    where = _where(shape, dtype, "contiguous", seed)
    for t in range(3):
        _call(prop, a, where, a.compress, make_tensor(shape, dtype, "contiguous", seed + 10 + t),
              step=t, key="state", generator=seed + t)
    state = _call(prop, a, where, a.state_dict)
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
    except Exception as exc:
        raise _fail(prop, a, f"state_dict() does not round-trip through torch.save / "
                    f"torch.load(weights_only=True): {type(exc).__name__}: {exc}", where) from exc
    b = fresh()
    _call(prop, b, where, b.load_state_dict, loaded)
    x = make_tensor(shape, dtype, "contiguous", seed + 20)
    pa = _call(prop, a, where, a.compress, x, step=3, key="state", generator=seed + 3)
    pb = _call(prop, b, where, b.compress, x, step=3, key="state", generator=seed + 3)
    diff = _same_payload(pa, pb)
    if diff is not None:
        raise _fail(prop, a, f"a fresh instance loaded with state_dict() gives another next payload: {diff}",
                    where)


def check_aggregation(compressor: CompressorLike, *, seed: int = 0, examples: int = DEFAULT_EXAMPLES) -> None:
    """The payload matches :attr:`~commpress.Compressor.aggregation`:

    * ``"sparse"``: ``tensors == (indices, values)``, 1-D, as many of each, integer indices
      and values in the input's dtype; ``compress``'s indices unique and in ``[0, numel)``,
      ``compress_fixed``'s too except for padding slots (index ``numel``, value 0);
    * ``"sum"``: two ranks' payloads (two instances, same step and key) added tensor by tensor
      decode to the sum of their decodes, within the wire and input dtypes' rounding;
    * ``"gather"`` / ``"lowrank"``: the payload decodes (of ``compress_fixed`` too).

    Args:
        compressor: a :class:`~commpress.Compressor`, or a callable building a fresh one.
        seed: offset of every input's seed.
        examples: inputs drawn by hypothesis after the odd ones.

    Raises:
        AssertionError: ``aggregation "<kind>"`` and the failing input.
        ImportError: hypothesis is not installed.

    Example:
        >>> check_aggregation(commpress.get("fp16"))
    """
    fresh = _factory(compressor)
    c = fresh()
    kind = c.aggregation
    prop = f'aggregation "{kind}"'
    if kind not in ("sum", "sparse", "gather", "lowrank"):
        raise _fail("aggregation", c, f"unknown aggregation {kind!r}")

    def body(shape, dtype, layout, s):
        where = _where(shape, dtype, layout, s)
        x = make_tensor(shape, dtype, layout, s)
        n = x.numel()
        if kind == "sparse":
            for name in ("compress", "compress_fixed"):
                p = _call(prop, c, where, getattr(c, name), x, step=s % 5, key="agg", generator=s)
                if len(p.tensors) != 2:
                    raise _fail(prop, c, f"{name}: expected (indices, values), got {len(p.tensors)} tensors", where)
                idx, values = p.tensors
                if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1 or values.dim() != 1 \
                        or idx.numel() != values.numel() or values.dtype != x.dtype:
                    raise _fail(prop, c, f"{name}: indices {idx.dtype} {tuple(idx.shape)}, values {values.dtype} "
                                f"{tuple(values.shape)}: expected 1-D int32/int64 indices and as many "
                                f"{x.dtype} values", where)
                i = idx.long()
                pad = (i == n) if name == "compress_fixed" else torch.zeros_like(i, dtype=torch.bool)
                if bool(((i < 0) | (i > n) | ((i == n) & ~pad)).any()):
                    raise _fail(prop, c, f"{name}: an index outside [0, {n})", where)
                if bool((values[pad].float() != 0).any()):
                    raise _fail(prop, c, f"{name}: a padding slot (index {n}) with a nonzero value", where)
                real = i[~pad]
                if real.numel() != torch.unique(real).numel():
                    raise _fail(prop, c, f"{name}: repeated indices", where)
        elif kind == "sum":
            ca, cb = fresh(), fresh()
            y = make_tensor(shape, dtype, layout, s + 1)
            pa = _call(prop, ca, where, ca.compress, x, step=s % 5, key="agg", generator=s)
            pb = _call(prop, cb, where, cb.compress, y, step=s % 5, key="agg", generator=s + 1)
            if len(pa.tensors) != len(pb.tensors) or any(
                    u.shape != v.shape or u.dtype != v.dtype for u, v in zip(pa.tensors, pb.tensors)):
                raise _fail(prop, c, "two inputs of the same shape give wire tensors of different shapes", where)
            try:
                total = Payload(tuple(u + v for u, v in zip(pa.tensors, pb.tensors)), pa.shape, pa.dtype,
                                pa.numel, dict(pa.meta))
            except Exception as exc:
                raise _fail(prop, c, f"the wire tensors do not add: {type(exc).__name__}: {exc}", where) from exc
            got = _call(prop, ca, where, ca.decompress, total).double()
            want = _call(prop, ca, where, ca.decompress, pa).double() + _call(prop, ca, where, ca.decompress, pb).double()
            eps = max([torch.finfo(x.dtype).eps] + [torch.finfo(t.dtype).eps for t in pa.tensors
                                                    if t.is_floating_point()])
            mag = _call(prop, ca, where, ca.decompress, pa).double().abs() \
                + _call(prop, ca, where, ca.decompress, pb).double().abs()
            tol = 4 * eps * mag + 1e-30
            if got.shape != want.shape or bool(((got - want).abs() > tol).any()):
                worst = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
                raise _fail(prop, c, "decompress of the sum of two payloads is not the sum of their decodes "
                            f"(largest difference {worst:.3g})", where)
        else:
            for name in ("compress", "compress_fixed"):
                p = _call(prop, c, where, getattr(c, name), x, step=s % 5, key="agg", generator=s)
                out = _call(prop, c, where, c.decompress, p)
                if tuple(out.shape) != tuple(x.shape):
                    raise _fail(prop, c, f"{name}: decodes to shape {tuple(out.shape)}", where)

    _property(prop, c, body, seed=seed, examples=examples)


CHECKS: dict[str, Callable[..., None]] = {
    "round_trip": check_round_trip,
    "wire_size": check_wire_size,
    "deterministic": check_deterministic,
    "unbiased": check_unbiased,
    "error_feedback": check_error_feedback,
    "state_dict": check_state_dict,
    "aggregation": check_aggregation,
}


def check_compressor(compressor: CompressorLike, *, seed: int = 0, examples: int = DEFAULT_EXAMPLES,
                     checks: tuple[str, ...] | None = None) -> None:
    """Check that ``compressor`` keeps the compressor contract (:mod:`commpress.compressors.base`):
    :func:`check_round_trip`, :func:`check_wire_size`, :func:`check_deterministic`,
    :func:`check_unbiased` (when it declares ``unbiased``), :func:`check_error_feedback` (when it
    does not), :func:`check_state_dict` and :func:`check_aggregation`, in that order.  The checks
    build fresh instances configured like ``compressor`` and leave it untouched.

    Args:
        compressor: a :class:`~commpress.Compressor` (registered with
            :func:`commpress.compressors.register`, or a plain subclass), or a callable with no
            arguments that builds a fresh one (needed for a plain subclass whose state
            :func:`copy.deepcopy` cannot copy).
        seed: offset of every seed the checks use; the same seed runs the same examples.
        examples: inputs hypothesis draws per shape check (after the fixed odd inputs).
        checks: names of the checks to run (keys of :data:`CHECKS`); ``None``: all.

    Raises:
        AssertionError: the first broken property, named at the start of the message, with the
            (minimal) failing input: shape, dtype, layout and seed.
        ImportError: hypothesis is not installed (``pip install hypothesis``).
        ValueError: an unknown name in ``checks``.

    Example:
        >>> from commpress.testing import check_compressor
        >>> check_compressor(commpress.get("topk", ratio=0.1))
        >>> check_compressor(MyCompressor())            # a plain subclass of commpress.Compressor
        >>> check_compressor(lambda: MyCompressor(bits=3), examples=50)
    """
    names = tuple(CHECKS) if checks is None else tuple(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; allowed: {', '.join(CHECKS)}")
    _hypothesis()
    fresh = _factory(compressor)
    for name in names:
        fn = CHECKS[name]
        if name in ("round_trip", "wire_size", "deterministic", "aggregation"):
            fn(fresh, seed=seed, examples=examples)
        else:
            fn(fresh, seed=seed)
