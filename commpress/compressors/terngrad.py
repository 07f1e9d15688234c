"""``terngrad``: ternary {-1, 0, 1}·max|x| with stochastic rounding (Wen et al., 2017)."""

from __future__ import annotations

import torch

from .. import ops
from ._util import seed_from_generator
from .base import Compressor, Payload, register
from .qsgd import decode_codes, stochastic_codes


@register("terngrad")
class TernGrad(Compressor):
    """TernGrad: ``s = max|x|``, entry ``i`` becomes ``sign(x_i)*s`` with probability
    ``|x_i|/s`` and 0 otherwise, so it is unbiased (variance ``|x_i|(s-|x_i|)``).

    Wire: ``s`` as fp32 (4 bytes) and 2 bits per entry (codes 0, 1, 2 packed with
    :func:`commpress.ops.pack_bits`): ``ceil(numel/4) + 4`` bytes.  Noise comes
    from ``generator``.  A NaN/inf entry makes ``s`` non-finite and the decoded
    tensor NaN.  (The paper's layer-wise clipping is left to the caller.)
    """

    aggregation = "gather"
    unbiased = True
    deterministic = False

    def __init__(self) -> None:
        pass

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        x = tensor.reshape(-1).float()
        scale = x.abs().amax().reshape(1) if x.numel() else x.new_zeros(1)
        codes = stochastic_codes(x, scale, 1, seed_from_generator(generator))
        return self.make_payload(tensor, (ops.pack_bits(codes, 2), scale))

    def decompress(self, payload: Payload) -> torch.Tensor:
        packed, scale = payload.tensors
        codes = ops.unpack_bits(packed, 2, payload.numel)
        return decode_codes(codes, scale, 1).to(payload.dtype).reshape(payload.shape)
