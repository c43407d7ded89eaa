"""Tests for the execution-level objective and the chunked log-probs (docs/design.md §2)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwengyre.engines.embedded import behaviour_logprobs
from qwengyre.training.logprobs import token_logprobs
from qwengyre.training.objective import ObjectiveOutput, execution_gspo_loss


def _run(
    lp: list[float], b: list[float], ex: list[int], adv: list[float], **kw: Any
) -> tuple[ObjectiveOutput, np.ndarray]:
    cur = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    out = execution_gspo_loss(
        cur,
        torch.tensor(b, dtype=torch.float32),
        torch.tensor(ex),
        torch.tensor(adv, dtype=torch.float32),
        **kw,
    )
    out.loss.backward()
    assert cur.grad is not None
    return out, cur.grad.numpy()


L = [-1.0, -2.0, -0.5, -1.5, -0.3]
EX = [0, 0, 0, 1, 1]
ADV = [1.0, -0.5]


def test_hand_computed_on_policy() -> None:
    # b == l: w_t = 1, s_i = 1. loss = -(1*mean(-1,-2,-.5) - .5*mean(-1.5,-.3)) / 2
    out, grad = _run(L, L, EX, ADV)
    assert out.loss.item() == pytest.approx(-((-3.5 / 3) + 0.45) / 2, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.358333333, abs=1e-6)
    np.testing.assert_allclose(grad, [-1 / 6] * 3 + [0.125] * 2, atol=1e-7)
    assert out.clipped_fraction.item() == 0.0
    assert out.mean_ratio.item() == pytest.approx(1.0)
    assert out.token_weight_mean.item() == pytest.approx(1.0)


def test_the_kl_estimate_is_zero_on_policy_and_the_k3_sum_off_it() -> None:
    on, _ = _run(L, L, EX, ADV)
    assert on.kl_sum.item() == 0.0
    delta = np.array([0.3, -0.2, 0.0, 0.5, -0.1])
    off, _ = _run(L, (np.array(L) - delta).tolist(), EX, ADV)
    expected = float(np.sum(np.exp(delta) - 1 - delta))  # r - 1 - log r, r = exp(delta)
    assert off.kl_sum.item() == pytest.approx(expected, rel=1e-5) and expected > 0


def test_numpy_reference_off_policy() -> None:
    delta = np.array([0.001, -0.002, 0.0, 0.003, -0.001])
    b = (np.array(L) - delta).tolist()
    out, grad = _run(L, b, EX, ADV)
    w = np.exp(delta)
    lv, ex, adv = np.array(L), np.array(EX), np.array(ADV)
    surr = [adv[i] * np.mean((w * lv)[ex == i]) for i in range(2)]
    assert out.loss.item() == pytest.approx(-sum(surr) / 2, abs=1e-6)
    n = np.array([3, 2])
    np.testing.assert_allclose(grad, -adv[ex] * w / (n[ex] * 2), rtol=1e-6)
    ratios = [np.exp(delta[ex == i].mean()) for i in range(2)]
    assert out.mean_ratio.item() == pytest.approx(np.mean(ratios), abs=1e-6)
    assert out.token_weight_mean.item() == pytest.approx(w.mean(), abs=1e-6)


@pytest.mark.parametrize(
    ("adv", "delta", "clipped"),
    [
        (1.0, 0.01, True),  # A > 0, s > clip_high
        (1.0, -0.01, False),
        (1.0, 0.004, False),  # inside the band
        (-1.0, -0.01, True),  # A < 0, s < clip_low
        (-1.0, 0.01, False),
        (-1.0, -0.004, False),
    ],
)
def test_clipping_removes_gradient_exactly_when_clipped(
    adv: float, delta: float, clipped: bool
) -> None:
    lp = [-1.0, -2.0, -0.7, -0.4]
    b = [lp[0] - delta, lp[1] - delta, lp[2], lp[3]]
    out, grad = _run(lp, b, [0, 0, 1, 1], [adv, 0.5])
    if clipped:
        assert np.all(grad[:2] == 0.0)
        assert out.clipped_fraction.item() == 0.5
    else:
        np.testing.assert_allclose(grad[:2], [-adv * math.exp(delta) / 4] * 2, rtol=1e-5)
        assert out.clipped_fraction.item() == 0.0
    # the other execution is untouched
    np.testing.assert_allclose(grad[2:], [-0.5 / 4] * 2, rtol=1e-6)


@pytest.mark.parametrize("variant", ["default", "token_sum"])
def test_micro_step_sums_divided_once_equal_the_batch_loss(variant: str) -> None:
    # Micro-steps hold whole executions and pass normaliser=1; dividing their summed
    # losses by the batch's N (or target tokens) gives the whole batch's loss.
    delta = np.array([0.001, -0.002, 0.0, 0.003, -0.001])
    b = (np.array(L) - delta).tolist()
    whole, _ = _run(L, b, EX, ADV, variant=variant)
    parts = [_run(L[:3], b[:3], [0] * 3, ADV[:1], variant=variant, normaliser=1.0)[0]]
    parts.append(_run(L[3:], b[3:], [0] * 2, ADV[1:], variant=variant, normaliser=1.0)[0])
    divisor = 2 if variant == "default" else 5
    total = sum(p.loss.item() for p in parts) / divisor
    assert total == pytest.approx(whole.loss.item(), abs=1e-7)


def test_token_weight_cap() -> None:
    lp = [-1.0, -2.0, -0.7]
    b = [lp[0] - 3.0, lp[1] + 3.0, lp[2]]  # deltas +3, -3, 0: s = 1, exp(3) > 5
    out, grad = _run(lp, b, [0, 0, 0], [1.0], token_weight_cap=5.0)
    np.testing.assert_allclose(grad, [-5.0 / 3, -math.exp(-3.0) / 3, -1.0 / 3], rtol=1e-5)
    assert out.token_weight_mean.item() == pytest.approx((5 + math.exp(-3) + 1) / 3, rel=1e-5)
    _, grad_big = _run(lp, b, [0, 0, 0], [1.0], token_weight_cap=100.0)
    assert grad_big[0] == pytest.approx(-math.exp(3.0) / 3, rel=1e-5)


def test_equal_weight_per_execution_under_duplication() -> None:
    delta = [0.001, -0.002, 0.0, 0.003, -0.001]
    b = [x - d for x, d in zip(L, delta, strict=True)]
    out, grad = _run(L, b, EX, ADV)
    # execution 0 twice as long, same per-token values
    l2 = L[:3] * 2 + L[3:]
    b2 = b[:3] * 2 + b[3:]
    ex2 = [0] * 6 + [1, 1]
    out2, grad2 = _run(l2, b2, ex2, ADV)
    assert out2.loss.item() == pytest.approx(out.loss.item(), abs=1e-6)
    np.testing.assert_allclose(grad2[6:], grad[3:], rtol=1e-6)
    np.testing.assert_allclose(grad2[:3] + grad2[3:6], grad[:3], rtol=1e-6)
    # token_sum, by contrast, weighs the longer execution more
    ts, _ = _run(L, b, EX, ADV, variant="token_sum")
    ts2, _ = _run(l2, b2, ex2, ADV, variant="token_sum")
    assert ts2.loss.item() != pytest.approx(ts.loss.item(), abs=1e-3)


def test_token_sum_hand_computed() -> None:
    out, grad = _run(L, L, EX, ADV, variant="token_sum")
    assert out.loss.item() == pytest.approx(-(-3.5 + 0.9) / 5, abs=1e-6)
    np.testing.assert_allclose(grad, [-1 / 5] * 3 + [0.5 / 5] * 2, atol=1e-7)


def test_per_trajectory_clip() -> None:
    # execution 0: trajectory 7 drifts up (+0.01), trajectory 9 down (-0.01): s_0 = 1.
    lp = [-1.0, -2.0, -0.5, -1.5, -0.3]
    delta = [0.01, 0.01, -0.01, -0.01, 0.0]
    b = [x - d for x, d in zip(lp, delta, strict=True)]
    ex = [0, 0, 0, 0, 1]
    traj = torch.tensor([7, 7, 9, 9, 3])
    default, g_def = _run(lp, b, ex, [1.0, 1.0])
    assert default.clipped_fraction.item() == 0.0
    assert np.all(g_def[:2] != 0.0)
    out, grad = _run(lp, b, ex, [1.0, 1.0], variant="per_trajectory_clip", trajectory_index=traj)
    assert np.all(grad[:2] == 0.0)
    np.testing.assert_allclose(grad[2:4], [-math.exp(-0.01) / (4 * 2)] * 2, rtol=1e-5)
    np.testing.assert_allclose(grad[4], -1.0 / 2, rtol=1e-6)
    assert out.clipped_fraction.item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        _run(lp, b, ex, [1.0, 1.0], variant="per_trajectory_clip")


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_logprobs_match_unchunked(temperature: float, chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, generator=gen, requires_grad=True)
    weight = torch.randn(50, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)

    ref = behaviour_logprobs(hidden @ weight.T, targets, temperature)
    gh_ref, gw_ref = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    got = token_logprobs(hidden, weight, targets, temperature, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad((got * upstream).sum(), [hidden, weight])

    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, gh_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, gw_ref, atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_bf16_inputs_grad_dtype() -> None:
    hidden = torch.randn(6, 4).bfloat16().requires_grad_()
    weight = torch.randn(9, 4).bfloat16().requires_grad_()
    out = token_logprobs(hidden, weight, torch.arange(6), chunk_tokens=4)
    out.sum().backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[float], list[float], list[int], list[float]]:
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    n = sum(sizes)
    fl = st.floats(-10.0, 0.0)
    lp = draw(st.lists(fl, min_size=n, max_size=n))
    d = draw(st.lists(st.floats(-0.02, 0.02), min_size=n, max_size=n))
    adv = draw(st.lists(st.floats(-2.0, 2.0), min_size=len(sizes), max_size=len(sizes)))
    ex = [i for i, k in enumerate(sizes) for _ in range(k)]
    return lp, [x - y for x, y in zip(lp, d, strict=True)], ex, adv


@settings(max_examples=60, deadline=None)
@given(_batches())
def test_random_loss_finite_and_gradient_mass(
    batch: tuple[list[float], list[float], list[int], list[float]],
) -> None:
    lp, b, ex, adv = batch
    out, grad = _run(lp, b, ex, adv)
    assert math.isfinite(out.loss.item())
    assert np.all(np.isfinite(grad))
    # documented: sum_{t in i} (dloss/dl_t) / w_t = -A_i / N if unclipped, else 0
    lv = np.array(lp, dtype=np.float32)
    bv = np.array(b, dtype=np.float32)
    exv = np.array(ex)
    delta = lv.astype(np.float64) - bv
    w = np.minimum(np.exp(delta), 5.0)
    n_exec = len(adv)
    for i, a in enumerate(adv):
        s = np.exp(delta[exv == i].mean())
        clipped = (a > 0 and s > 1.005) or (a < 0 and s < 0.995)
        if abs(s - 1.005) < 1e-5 or abs(s - 0.995) < 1e-5:
            continue  # fp32/fp64 disagreement at the boundary
        mass = float(np.sum(grad[exv == i] / w[exv == i]))
        expected = 0.0 if clipped else -a / n_exec
        assert mass == pytest.approx(expected, abs=1e-5)
