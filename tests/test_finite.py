"""lightning_gc._finite.all_finite: the engine's finiteness check (dense buckets, exact groups,
OSP's deferred gradients, DiLoCo's pseudo-gradient, GradiVeQ's samples) answers exactly as
``torch.isfinite(t).all()`` does, including where its fast path (a sum) cannot decide."""

from __future__ import annotations

import pytest
import torch

from lightning_gc._finite import all_finite


def _oracle(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_agrees_with_the_element_wise_check_wherever_a_bad_value_sits(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 5000, (1,), generator=g))
        t = torch.randn(n, generator=g).to(dtype)
        bad = trial % 4  # 0: none, 1: NaN, 2: one inf, 3: +inf and -inf (their sum is NaN)
        if bad:
            idx = torch.randint(0, n, (2,), generator=g)
            t[idx[0]] = float("nan") if bad == 1 else float("inf")
            if bad == 3:
                t[idx[1]] = float("-inf")
        assert _oracle(t) is (bad == 0)  # the oracle agrees with how the tensor was made
        assert all_finite(t) is (bad == 0), (trial, n, bad)


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((1000,), 3.0e38)  # each finite; their fp32 sum is +inf
    assert torch.isinf(big.sum()) and _oracle(big)
    assert all_finite(big) is True
    half = torch.full((100,), 60000.0, dtype=torch.float16)  # fp16 max is 65504; the sum 6e6 is not
    assert all_finite(half) is True
    mixed = torch.cat([big, -big[:10], torch.tensor([float("nan")])])
    assert all_finite(mixed) is False


def test_shapes_and_empty():
    assert all_finite(torch.empty(0)) is True
    assert all_finite(torch.tensor(1.5)) is True
    assert all_finite(torch.tensor(float("-inf"))) is False
    m = torch.randn(7, 9)
    m[3, 4] = float("nan")
    assert all_finite(m) is False and all_finite(m[:3]) is True
