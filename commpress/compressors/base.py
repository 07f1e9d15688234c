"""The compressor contract: :class:`Payload`, :class:`Compressor` and the registry.

A compressor turns one gradient tensor into a :class:`Payload` (the tensors that go
on the wire plus the few facts needed to decode them) and back.  How payloads of
several ranks are combined is given by :attr:`Compressor.aggregation`:

``"sum"``
    payload tensors add elementwise (identity, fp16, bf16, shared-seed random-k):
    an ``all_reduce`` of the wire tensors, then ``decompress``.
``"sparse"``
    ``payload.tensors == (indices, values)``: unique, in-range indices (int32 when
    ``numel < 2**31``) and their values; summed by a sparse allreduce.
``"gather"``
    codes that must be decoded before they can be added (quantizers): the
    two-phase quantized allreduce decodes, sums in fp32 and re-encodes.
``"lowrank"``
    PowerSGD factors P, Q: the PowerSGD protocol (two ``all_reduce`` calls).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

AGGREGATIONS = ("sum", "sparse", "gather", "lowrank")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Payload:
    """What one rank sends for one tensor.

    A frozen dataclass made by :meth:`Compressor.compress` (usually through
    :meth:`Compressor.make_payload`) and read by :meth:`Compressor.decompress`.
    Only ``tensors`` goes on the wire.

    Attributes:
        tensors: exactly what goes on the wire; :attr:`nbytes` is its true size in
            bytes after bit packing.
        shape: the original tensor's shape.
        dtype: the original tensor's dtype.
        numel: the original tensor's number of elements.
        meta: small decode facts (never sent per element, derivable by every rank
            from the configuration and ``numel``).
        nonfinite: a 0-d bool set by :class:`~commpress.ErrorFeedback` when the
            compensated input held a NaN/inf (``None`` when nobody scanned it); the
            collectives put it in their status word instead of scanning the input
            again.  It is not sent as a tensor of its own.

    Example:
        >>> payload = commpress.get("fp16").compress(torch.randn(4, 8))
        >>> payload.shape, payload.numel, payload.nbytes
        (torch.Size([4, 8]), 32, 64)
    """

    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype
    numel: int
    meta: dict[str, Any] = field(default_factory=dict)
    nonfinite: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum of the wire tensors' sizes."""
        return int(sum(t.numel() * t.element_size() for t in self.tensors))

    @property
    def dense_nbytes(self) -> int:
        """Bytes the uncompressed tensor would take in its own dtype."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")


class Compressor(ABC):
    """Base class of all compressors: encode a tensor to a :class:`Payload` and back.

    Subclasses set :attr:`name` (through :func:`register`), :attr:`aggregation`
    and :attr:`unbiased`, and implement :meth:`compress` / :meth:`decompress`.
    ``compress`` accepts fp32, fp16 and bf16 tensors of any shape (contiguous or
    not, empty included); ``decompress`` returns the input's shape and dtype.
    What goes on the wire is ``payload.tensors``; how several ranks' payloads are
    combined is :attr:`aggregation` (see :mod:`commpress.compressors.base`).

    Attributes:
        name: the registry name (set by :func:`register`).
        aggregation: ``"sum"``, ``"sparse"``, ``"gather"`` or ``"lowrank"``.
        unbiased: True when ``E[decompress(compress(x))] == x`` (no error feedback
            needed).
        deterministic: True when compress is a deterministic function of
            ``(tensor, step, key)``.
        supported_dtypes: the input dtypes :meth:`compress` accepts.

    Example:
        >>> @commpress.register("half")
        ... class Half(commpress.Compressor):
        ...     casts, cast_to = True, torch.float16
        ...     def compress(self, tensor, *, step=0, key=0, generator=None):
        ...         return self.make_payload(tensor, (tensor.to(torch.float16),))
        ...     def decompress(self, payload):
        ...         return payload.tensors[0].to(payload.dtype).reshape(payload.shape)
    """

    name: ClassVar[str] = ""
    aggregation: ClassVar[str] = "sum"
    #: True when ``E[decompress(compress(x))] == x`` (no error feedback needed).
    unbiased: ClassVar[bool] = True
    #: True when compress is a deterministic function of (tensor, step, key).
    deterministic: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES

    # -- declared features: the collectives and hooks read these, nothing is sniffed --------
    #: an elementwise cast (identity, fp16, bf16): the payload is the input cast to
    #: :attr:`cast_to` (``None``: the input's own dtype), so a collective writes that cast
    #: (scaled, when it averages) straight into its message buffer
    casts: ClassVar[bool] = False
    cast_to: torch.dtype | None = None
    #: ``decompress(compress(x))`` is ``x`` bit for bit (identity): error feedback keeps no decode
    #: buffer for it (its residual after a send is zero)
    exact: ClassVar[bool] = False
    #: :meth:`compress_feedback` exists: error feedback runs as one fused pass
    fused_feedback: ClassVar[bool] = False
    #: :meth:`compress_feedback` also takes momentum correction's velocity (:meth:`fuses_velocity`)
    fused_velocity: ClassVar[bool] = False
    #: a sparsifier whose fixed-size payload always fills its capacity with selected entries
    #: (never the padding index), so its sum can be scattered straight into the output
    fills_capacity: ClassVar[bool] = False
    #: a non-finite input always shows in the payload's values (so the NaN/inf verdict can
    #: read the payload instead of scanning the whole input)
    keeps_nonfinite: ClassVar[bool] = False

    @property
    def alignment(self) -> int:
        """Chunk boundaries of the two-phase collectives fall on multiples of this (a block
        quantizer's block, so no block straddles two owners); 1 by default."""
        return 1

    def capacity(self, numel: int, step: int | None = None) -> int:
        """Entries of the fixed-size wire format of a sparsifier for ``numel`` elements at
        ``step`` (its density warm-up; ``None``: the target density); 0 for the other kinds."""
        return 0

    def ratio_at(self, step: int) -> float | None:
        """The density a sparsifier sends at ``step`` (its warm-up schedule); ``None`` for the
        kinds whose payload size does not change with the step."""
        return None

    def is_compressed(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor of this shape is compressed at all (a low-rank compressor sends
        vectors as they are); decided from the shape alone, so alike on every rank."""
        return True

    #: the devices whose tensors :meth:`compress_feedback` takes (``None``: every device); e.g.
    #: ``("cpu",)`` where the fused op has no CUDA kernel and a GPU keeps the separate kernels
    fused_feedback_devices: ClassVar[tuple[str, ...] | None] = None

    def fuses_feedback(self, tensor: torch.Tensor, fixed: bool = True) -> bool:
        """Whether error feedback runs :meth:`compress_feedback` for ``tensor`` (with the
        fixed-size wire format when ``fixed``); default: :attr:`fused_feedback`, fp32 input, on
        one of :attr:`fused_feedback_devices`."""
        devices = self.fused_feedback_devices
        return (self.fused_feedback and tensor.dtype == torch.float32
                and (devices is None or tensor.device.type in devices))

    def fuses_velocity(self, tensor: torch.Tensor, fixed: bool = True) -> bool:
        """Whether :meth:`compress_feedback` also takes momentum correction's velocity
        (``velocity=(live, momentum, new)``, :func:`commpress.ops.reference.accumulate_velocity`)
        for ``tensor``, so error feedback makes no pass of its own for it: where a compressor
        declares :attr:`fused_velocity`, wherever its feedback is fused (:meth:`fuses_feedback`)."""
        return self.fused_velocity and self.fuses_feedback(tensor, fixed)

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          pending: torch.Tensor, *, step: int = 0, key: Any = 0, fixed: bool = False,
                          scale: float = 1.0) -> tuple["Payload", torch.Tensor]:
        """With :attr:`fused_feedback`: compensate ``tensor*scale + beta*residual`` (``residual``
        ``None``: zero), encode it (the fixed-size wire format when ``fixed``) and write the
        next residual into ``pending`` in one pass; returns ``(payload, finite)``.  A compressor
        that is not :attr:`deterministic` also takes ``generator=`` (its noise, as in :meth:`compress`),
        which error feedback passes on."""
        raise NotImplementedError(f"{self.name} has no fused error feedback (fused_feedback is False)")

    @abstractmethod
    def compress(
        self,
        tensor: torch.Tensor,
        *,
        step: int = 0,
        key: Any = 0,
        generator: torch.Generator | None = None,
    ) -> Payload:
        """Encode ``tensor``. ``step``/``key`` seed shared random choices;
        ``generator`` supplies per-rank noise (stochastic rounding): a
        ``torch.Generator``, or an int used as this call's seed (no tensor read)."""

    def compress_fixed(self, tensor: torch.Tensor, *, step: int = 0, key: Any = 0,
                       generator: torch.Generator | None = None) -> Payload:
        """:meth:`compress` with a wire size that depends only on ``(numel, dtype)``
        and the configuration, never on the data: what the collectives send, so
        every rank knows every message size without asking.  Most compressors are
        fixed-size already (this default); sparsifiers with a data-dependent count
        pad to a capacity (see :class:`~commpress.compressors._sparse.SparseCompressor`)."""
        return self.compress(tensor, step=step, key=key, generator=generator)

    @abstractmethod
    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode a payload to a tensor of the original shape and dtype.

        ``out``: optional contiguous tensor of ``payload.dtype`` with ``payload.numel``
        elements on the payload's device.  The result is written into it and returned
        (viewed with ``payload.shape`` when its shape differs), so a caller that keeps
        one buffer per tensor allocates nothing per call (fp32 payloads; half
        precision decodes through an fp32 temporary).
        """

    # -- state (warm starts, counters) ----------------------------------
    def state_dict(self) -> dict[str, Any]:
        """State that must survive a restart (e.g. PowerSGD warm starts).

        Only tensors, numbers, strings and containers of them, so it loads with
        ``torch.load(weights_only=True)``.  Stateless compressors return ``{}``.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{self.name} is stateless but got state keys {sorted(state)}")

    # -- configuration -------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The parameters this compressor was built with (for fingerprints)."""
        return dict(getattr(self, "_config", {}))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    # -- helpers for subclasses ----------------------------------------
    def check_input(self, tensor: torch.Tensor) -> None:
        """Raise ``TypeError`` for a non-tensor or an unsupported dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in self.supported_dtypes:
            allowed = ", ".join(str(d) for d in self.supported_dtypes)
            raise TypeError(
                f"{self.name}: unsupported dtype {tensor.dtype}; supported: {allowed}"
            )

    def decode_target(self, payload: Payload, out: torch.Tensor | None) -> torch.Tensor | None:
        """Check ``out`` (see :meth:`decompress`); return its flat fp32 view when an op may
        decode straight into it (fp32 payload), else ``None``."""
        if out is None:
            return None
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{self.name}: out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != payload.dtype or out.numel() != payload.numel or not out.is_contiguous() \
                or out.device != payload.device:
            raise ValueError(
                f"{self.name}: out must be a contiguous {payload.dtype} tensor of {payload.numel} "
                f"elements on {payload.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}")
        return out.view(-1) if out.dtype == torch.float32 else None

    @staticmethod
    def finish_decode(payload: Payload, values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``values`` (decoded, any float dtype, ``payload.numel`` entries) as the result of
        :meth:`decompress`: in ``out`` when given (no copy if it already is ``out``)."""
        if out is None:
            return values.to(payload.dtype).reshape(payload.shape)
        flat = out.view(-1)
        if not (values.data_ptr() == flat.data_ptr() and values.dtype == flat.dtype):
            flat.copy_(values.reshape(-1))
        return out if out.shape == payload.shape else out.view(payload.shape)

    def make_payload(
        self, tensor: torch.Tensor, tensors: tuple[torch.Tensor, ...], **meta: Any
    ) -> Payload:
        return Payload(tuple(tensors), tensor.shape, tensor.dtype, tensor.numel(), meta)


_REGISTRY: dict[str, type[Compressor]] = {}


def register(name: str) -> Callable[[type[Compressor]], type[Compressor]]:
    """Class decorator: make a compressor available as ``commpress.get(name)``."""

    def deco(cls: type[Compressor]) -> type[Compressor]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"compressor name {name!r} is already registered")
        if cls.aggregation not in AGGREGATIONS:
            raise ValueError(f"{cls.__name__}.aggregation must be one of {AGGREGATIONS}")
        cls.name = name
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):  # records the bound config for fingerprints
            bound = inspect.signature(original_init).bind(self, *args, **kwargs)
            bound.apply_defaults()
            self._config = {k: v for k, v in list(bound.arguments.items())[1:]}
            original_init(self, *args, **kwargs)

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        if "out" not in inspect.signature(cls.decompress).parameters:
            _add_out(cls)
        __init__.__doc__ = original_init.__doc__
        cls.__init__ = __init__  # type: ignore[method-assign]
        _REGISTRY[name] = cls
        return cls

    return deco


def _add_out(cls: type[Compressor]) -> None:
    """Give a ``decompress(payload)`` without ``out`` the contract's ``out=``: decode, then copy."""
    plain = cls.decompress

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        self.decode_target(payload, out)
        return self.finish_decode(payload, plain(self, payload), out)

    decompress.__doc__ = plain.__doc__
    cls.decompress = decompress  # type: ignore[method-assign]


def available() -> list[str]:
    """Names of all registered compressors, sorted.

    Takes no arguments.

    Returns:
        The names :func:`get` accepts (each registered with :func:`register`),
        in sorted order.

    Example:
        >>> "topk" in commpress.available()
        True
    """
    return sorted(_REGISTRY)


def get(name: str, **params: Any) -> Compressor:
    """Build the compressor registered as ``name`` with ``params``.

    Args:
        name: a registry name (one of :func:`available`), or a :class:`Compressor`
            instance, which is returned as it is.
        **params: the compressor's constructor parameters (only with a name).

    Returns:
        A new instance of the compressor class registered as ``name`` (or ``name``
        itself when it is a :class:`Compressor`).

    Raises:
        ValueError: for an unknown name (listing the known ones), for parameters the
            compressor does not take (listing the ones it does), or for ``params``
            given with a compressor instance.

    Example:
        >>> comp = commpress.get("topk", ratio=0.01)
        >>> payload = comp.compress(grad)
        >>> dense = comp.decompress(payload)
    """
    if isinstance(name, Compressor):
        if params:
            raise ValueError("params can only be given with a compressor name")
        return name
    try:
        cls = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown compressor {name!r}; available: {', '.join(available())}"
        ) from None
    sig = inspect.signature(cls.__init__.__wrapped__)  # type: ignore[attr-defined]
    allowed = [p for p in sig.parameters if p != "self"]
    try:
        sig.bind(None, **params)
    except TypeError as exc:
        raise ValueError(
            f"bad parameters for compressor {name!r}: {exc}; allowed parameters: "
            f"{', '.join(allowed) or '(none)'}"
        ) from None
    return cls(**params)
