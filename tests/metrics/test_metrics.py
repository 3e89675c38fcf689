"""Continual metrics against the worked example of the metrics notes and hand-computed edge
cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clbench.metrics import continual as cm
from clbench.metrics.continual import Column, MatrixError, Variants, compute_metrics
from clbench.spec.schema import MetricVariants, ProtocolSpec

NAN = float("nan")
# The notes' example has stages 1..3 as rows and no base row; the base row is unknown here (NaN)
# and FWT's b is passed explicitly, so any use of row 0 by another metric would show up as None.
EXAMPLE = np.array([[NAN, NAN, NAN],
                    [.80, .10, .20],
                    [.85, .90, .30],
                    [.50, .70, .85]])
B = [.10, .15, .25]
STREAM3 = [Column("a"), Column("b"), Column("c")]


def test_worked_example_every_variant() -> None:
    assert cm.acc(EXAMPLE) == pytest.approx(0.6833, abs=1e-4)
    assert cm.bwt(EXAMPLE, "t_minus_1") == pytest.approx(-0.25)
    assert cm.bwt(EXAMPLE, "t") == pytest.approx(-0.1667, abs=1e-4)
    assert cm.fwt(EXAMPLE, "base", b=B) == pytest.approx(0.0, abs=1e-12)
    assert cm.fwt(EXAMPLE, "none") == pytest.approx(0.20)
    assert cm.forgetting(EXAMPLE, "max") == pytest.approx(0.275)
    assert cm.forgetting(EXAMPLE, "diagonal") == pytest.approx(0.25)
    assert cm.learning_accuracy(EXAMPLE) == pytest.approx(0.85)


def test_op_per_stage_and_average_incremental_accuracy() -> None:
    # OP_1 = .80, OP_2 = (.85 + .90) / 2, OP_3 = (.50 + .70 + .85) / 3
    ops = cm.op_per_stage(EXAMPLE)
    assert ops == pytest.approx([0.80, 0.875, 2.05 / 3])
    assert cm.average_incremental_accuracy(EXAMPLE) == pytest.approx((0.80 + 0.875 + 2.05 / 3) / 3)


def test_fwt_base_variant_reads_row_zero() -> None:
    R = EXAMPLE.copy()
    R[0] = B
    assert cm.fwt(R, "base") == pytest.approx(0.0, abs=1e-12)
    # with row 0 unknown and no explicit b, FWT is undefined, not silently 0
    with pytest.raises(cm.Undefined, match=r"R\[0\]\[1\]"):
        cm.fwt(EXAMPLE, "base")


def test_compute_metrics_records_variants_and_values() -> None:
    R = EXAMPLE.copy()
    R[0] = B
    proto = ProtocolSpec(metrics=["acc", "op", "aia", "la", "bwt", "fwt", "forgetting"],
                         variants=MetricVariants(bwt="t", fwt="none", forgetting="diagonal"))
    out = compute_metrics(R, STREAM3, proto)
    assert out["bwt"]["variant"] == "t" and out["bwt"]["value"] == pytest.approx(-0.5 / 3)
    assert out["fwt"]["variant"] == "none" and out["fwt"]["value"] == pytest.approx(0.20)
    assert out["forgetting"]["variant"] == "diagonal"
    assert out["forgetting"]["value"] == pytest.approx(0.25)
    assert out["acc"]["value"] == pytest.approx(2.05 / 3)
    assert out["op"]["per_stage"] == pytest.approx([0.80, 0.875, 2.05 / 3])
    assert out["op"]["value"] == pytest.approx(out["acc"]["value"])
    default = compute_metrics(R, STREAM3, Variants())
    assert default["bwt"]["variant"] == "t_minus_1"
    assert default["bwt"]["value"] == pytest.approx(-0.25)
    assert default["forgetting"]["value"] == pytest.approx(0.275)
    assert default["fwt"]["value"] == pytest.approx(0.0, abs=1e-12)


def test_single_stage_metrics_are_undefined_not_zero() -> None:
    R = np.array([[0.2, 0.5], [0.6, 0.4]])
    cols = [Column("math"), Column("ood_math", "ood")]
    out = compute_metrics(R, cols, metrics=["acc", "la", "bwt", "fwt", "forgetting",
                                            "ood_delta", "aia"])
    assert out["acc"]["value"] == pytest.approx(0.6)
    assert out["la"]["value"] == pytest.approx(0.6)
    assert out["aia"]["value"] == pytest.approx(0.6)
    assert out["ood_delta"]["value"] == pytest.approx(-0.1)
    for name in ("bwt", "fwt", "forgetting"):
        assert out[name]["value"] is None
        assert "at least 2 stages" in out[name]["note"]
    # the 1/T variant would be a fake 0 at T = 1: it is undefined too
    with pytest.raises(cm.Undefined):
        cm.bwt(R[:, :1], "t")


def test_all_zero_column() -> None:
    # task 2 is never learned: scores 0 everywhere
    R = np.array([[0.1, 0.0, 0.3],
                  [0.7, 0.0, 0.3],
                  [0.4, 0.0, 0.5]])
    cols = [Column("a"), Column("b"), Column("g", "general")]
    out = compute_metrics(R, cols)
    assert out["acc"]["value"] == pytest.approx(0.2)
    assert out["la"]["value"] == pytest.approx(0.35)
    assert out["bwt"]["value"] == pytest.approx(-0.3)
    assert out["fwt"]["value"] == pytest.approx(0.0)          # R[1][2] - R[0][2] = 0 - 0
    assert out["forgetting"]["value"] == pytest.approx(0.3)
    assert out["general_delta"]["value"] == pytest.approx(0.2)
    assert out["ood_delta"]["value"] is None
    assert "no probe" in out["ood_delta"]["note"]
    assert all(not math.isnan(v["value"]) for v in out.values() if v["value"] is not None)


def test_probes_are_excluded_from_stream_metrics() -> None:
    base = np.array([[0.1, 0.2], [0.5, 0.3], [0.4, 0.9]])
    with_probes = np.hstack([base, np.array([[0.0, 0.9], [1.0, 0.1], [1.0, 0.0]])])
    cols = [Column("a"), Column("b"), Column("o", "ood"), Column("g", "general")]
    a = compute_metrics(base, cols[:2])
    b = compute_metrics(with_probes, cols)
    for name in ("acc", "la", "bwt", "fwt", "forgetting", "aia"):
        assert a[name]["value"] == pytest.approx(b[name]["value"]), name
    assert b["acc"]["value"] == pytest.approx(0.65)
    assert b["ood_delta"]["value"] == pytest.approx(1.0)
    assert b["general_delta"]["value"] == pytest.approx(-0.9)


def test_lower_is_better_probe_delta_sign() -> None:
    R = np.array([[0.5, 10.0], [0.6, 8.0]])
    cols = [Column("a"), {"name": "ppl", "kind": "general", "higher_is_better": False}]
    out = compute_metrics(R, cols)
    assert out["general_delta"]["value"] == pytest.approx(2.0)  # perplexity fell by 2: better


def test_missing_cells_make_the_metric_undefined_and_name_them() -> None:
    R = np.array([[0.1, 0.2, 0.5],
                  [0.6, 0.2, 0.5],
                  [NAN, 0.7, None]], dtype=object)
    cols = [Column("a"), Column("b"), Column("o", "ood")]
    out = compute_metrics(R, cols)
    assert out["acc"]["value"] is None and "R[2][0]" in out["acc"]["note"]
    assert out["bwt"]["value"] is None and "R[2][0]" in out["bwt"]["note"]
    assert out["ood_delta"]["value"] is None and "R[2][2]" in out["ood_delta"]["note"]
    # metrics that do not touch the hole are unaffected
    assert out["la"]["value"] == pytest.approx(0.65)
    assert out["fwt"]["value"] == pytest.approx(0.0)


def test_intransigence_needs_a_joint_reference() -> None:
    R = EXAMPLE.copy()
    out = compute_metrics(R, STREAM3, metrics=["intransigence"])
    assert out["intransigence"]["value"] is None
    assert "joint" in out["intransigence"]["note"]
    out = compute_metrics(R, STREAM3, metrics=["intransigence"], joint=[0.9, 0.9, 0.9])
    assert out["intransigence"]["per_stage"] == pytest.approx([0.10, 0.0, 0.05])
    assert out["intransigence"]["value"] == pytest.approx(0.05)
    with pytest.raises(MatrixError, match="one score per stream task"):
        cm.intransigence(EXAMPLE, [0.9])


def test_shape_errors_are_clear() -> None:
    with pytest.raises(MatrixError, match="3 stage rows .* 2 tasks"):
        compute_metrics(EXAMPLE[:, :2], STREAM3[:2])
    with pytest.raises(MatrixError, match="2 columns are described"):
        compute_metrics(EXAMPLE, STREAM3[:2])
    with pytest.raises(MatrixError, match="stream columns must come first"):
        compute_metrics(np.zeros((2, 2)), [Column("o", "ood"), Column("a")])
    with pytest.raises(MatrixError, match="unknown kind"):
        compute_metrics(np.zeros((2, 1)), [{"name": "a", "kind": "probe"}])
    with pytest.raises(MatrixError, match="unknown metric"):
        compute_metrics(EXAMPLE, STREAM3, metrics=["accuracy"])
