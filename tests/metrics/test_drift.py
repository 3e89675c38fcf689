"""Parameter drift on matrices with known answers: identity, scaling, a rotated subspace, the
principal mask, the randomised path against the exact one, aggregation by layer kind."""

from __future__ import annotations

import math

import pytest
import torch

from clbench.metrics.drift import (
    DriftSettings,
    layer_kind,
    matrix_drift,
    model_drift,
    weight_matrices,
)


def _random(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def test_a_matrix_against_itself_has_not_drifted() -> None:
    w = _random(12, 8)
    d = matrix_drift(w, w.clone(), DriftSettings(k=4))
    assert (d.nss, d.changed_fraction, d.mask_overlap) == (0.0, 0.0, 1.0)
    assert d.max_angle == pytest.approx(0.0, abs=1e-9)  # degrees: rounding only
    assert d.parameters == 96


@pytest.mark.parametrize("scale", [1.1, 0.5, 3.0])
def test_a_scaled_matrix_shifts_its_spectrum_by_the_scale_and_keeps_its_subspaces(
        scale: float) -> None:
    w = _random(10, 6, seed=1)
    d = matrix_drift(w, scale * w, DriftSettings(k=3))
    assert d.nss == pytest.approx(abs(scale - 1.0), rel=1e-12)
    assert d.max_angle == pytest.approx(0.0, abs=1e-5)
    assert d.mask_overlap == 1.0
    assert d.changed_fraction == 1.0  # every entry moved by far more than 0.1%


def test_a_subspace_rotated_by_theta_has_principal_angle_theta() -> None:
    theta = math.radians(17.0)
    e = torch.eye(5, dtype=torch.float64)
    v = torch.eye(3, dtype=torch.float64)
    s = torch.tensor([5.0, 3.0], dtype=torch.float64)
    u0 = torch.stack([e[0], e[1]], dim=1)
    u1 = torch.stack([math.cos(theta) * e[0] + math.sin(theta) * e[3], e[1]], dim=1)
    w0 = (u0 * s) @ v[:, :2].T
    w1 = (u1 * s) @ v[:, :2].T
    d = matrix_drift(w0, w1, DriftSettings(k=2))
    assert d.left_angle == pytest.approx(17.0, abs=1e-6)
    assert d.right_angle == pytest.approx(0.0, abs=1e-6)
    assert d.nss == pytest.approx(0.0, abs=1e-12)  # a rotation keeps the singular values


def test_changed_fraction_counts_entries_beyond_the_relative_tolerance() -> None:
    w0 = torch.ones(2, 5, dtype=torch.float64)
    w1 = w0.clone()
    w1[0, 0] = 1.01     # 1% > 0.1%: changed
    w1[1, 1] = 1.0005   # 0.05%: not
    w1[1, 2] = -1.0     # sign flip: changed
    assert matrix_drift(w0, w1, DriftSettings(k=1)).changed_fraction == pytest.approx(2 / 10)


def test_principal_mask_overlap_follows_where_the_principal_structure_is() -> None:
    settings = DriftSettings(k=1, mask_fraction=1 / 9)  # one entry: the rank-1 peak
    w0 = torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    same_peak = torch.diag(torch.tensor([3.0, 2.5, 1.0], dtype=torch.float64))
    moved_peak = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert matrix_drift(w0, same_peak, settings).mask_overlap == 1.0
    assert matrix_drift(w0, moved_peak, settings).mask_overlap == 0.0


def test_the_principal_mask_holds_the_largest_entries_of_the_reconstruction() -> None:
    """The mask is the `fraction` of entries largest in magnitude in u diag(s) v^T, against a
    full sort of the reconstruction; entries tied with the last one kept are all in."""
    import numpy as np

    from clbench.metrics.drift import principal_mask

    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(70, 3, generator=g, dtype=torch.float64), \
        torch.randn(40, 3, generator=g, dtype=torch.float64)
    s = torch.tensor([3.0, 2.0, 0.5], dtype=torch.float64)
    magnitude = (u * s @ v.T).abs().to(torch.float32).flatten()
    order = torch.argsort(magnitude, descending=True)
    expected = np.zeros(70 * 40, dtype=bool)
    expected[order[:round(0.15 * 70 * 40)].numpy()] = True
    mask = np.unpackbits(principal_mask(u, s, v, 0.15).numpy())[:70 * 40].astype(bool)
    assert mask.sum() == 420 and np.array_equal(mask, expected)
    # ties: a rank-1 matrix of +-1 entries; the 20% largest are all 400 tied entries
    ones = torch.ones(20, 1, dtype=torch.float64)
    tied = principal_mask(ones, torch.ones(1, dtype=torch.float64), ones, 0.2)
    assert int(np.unpackbits(tied.numpy()).sum()) == 400


def test_the_randomised_path_agrees_with_the_exact_one_on_a_low_rank_matrix() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, 6, generator=g, dtype=torch.float64) @ \
        torch.randn(6, 200, generator=g, dtype=torch.float64)
    moved = base + 1e-3 * torch.randn(300, 200, generator=g, dtype=torch.float64)
    exact = matrix_drift(base, moved, DriftSettings(k=4))
    sketched = matrix_drift(base, moved, DriftSettings(k=4, exact_limit=50))
    # the two paths compute the singular values differently (svdvals; the Gram matrix's
    # eigenvalues), which here differ in the noise-level ones, 1e-4 of the largest
    assert sketched.nss == pytest.approx(exact.nss, rel=1e-3)
    assert sketched.max_angle == pytest.approx(exact.max_angle, abs=1e-3)
    assert sketched.mask_overlap == pytest.approx(exact.mask_overlap, abs=0.02)
    assert sketched == matrix_drift(base, moved, DriftSettings(k=4, exact_limit=50))


def test_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="one shape"):
        matrix_drift(torch.zeros(2, 3), torch.zeros(3, 2))


def test_matrices_are_grouped_by_layer_kind_and_weighted_by_size() -> None:
    assert [layer_kind(n) for n in ("model.embed_tokens.weight", "lm_head.weight",
                                    "model.layers.0.self_attn.q_proj.weight",
                                    "model.layers.0.mlp.down_proj.weight", "model.norm.weight")] \
        == ["embeddings", "embeddings", "attention", "mlp", "other"]
    big, small = _random(20, 10), _random(4, 5, seed=2)
    before = {"layers.0.mlp.up_proj.weight": big, "layers.0.self_attn.o_proj.weight": small,
              "layers.0.input_layernorm.weight": torch.ones(10, dtype=torch.float64)}
    after = {"layers.0.mlp.up_proj.weight": 2.0 * big,                 # NSS 1
             "layers.0.self_attn.o_proj.weight": small.clone(),        # NSS 0
             "layers.0.input_layernorm.weight": torch.zeros(10, dtype=torch.float64)}
    summary = model_drift(before, after, DriftSettings(k=2))
    assert summary["mlp"]["nss"] == pytest.approx(1.0)
    assert summary["attention"]["nss"] == 0.0
    assert summary["all"]["nss"] == pytest.approx(200 / 220)  # weighted by parameters
    assert summary["all"]["matrices"] == 2.0  # the 1-D norm weight is no matrix


def test_tied_weights_count_once() -> None:
    shared = torch.nn.Parameter(torch.zeros(4, 3))
    named = [("embed_tokens.weight", shared), ("lm_head.weight", shared),
             ("norm.weight", torch.nn.Parameter(torch.zeros(3)))]
    assert list(weight_matrices(named)) == ["embed_tokens.weight"]
