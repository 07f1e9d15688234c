"""What a collective remembers of a layout's payloads (for a rank whose compress fails later: zeros
of the right sizes) holds no tensor of a payload's size: for a dense kind that was a model-size
buffer per layout, in no hook's memory figure ("auto"'s dense units measured 4 B/param above their
reported memory)."""

from __future__ import annotations

import torch

import commpress
from commpress.collectives import quantized


def test_templates_keep_shapes_not_tensors_and_give_zeros_of_the_right_layout():
    inner = commpress.get("identity")
    flat = torch.randn(10_000)
    payload = inner.compress_fixed(flat)
    quantized._remember(inner, flat, [0, flat.numel()], [payload], 0)
    kept = quantized._TEMPLATES[inner]
    assert not any(isinstance(v, torch.Tensor) for shapes in kept.values() for s in shapes
                   for v in vars(s.template).values())
    assert all(s.template.tensors == () for shapes in kept.values() for s in shapes)
    (zeros,) = quantized._templates(inner, flat, [0, flat.numel()], 0)
    assert [t.shape for t in zeros.tensors] == [t.shape for t in payload.tensors]
    assert all(not t.any() for t in zeros.tensors) and zeros.numel == payload.numel
