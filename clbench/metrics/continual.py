"""Continual-learning metrics: pure functions of the accuracy matrix R and its column metadata.

Conventions (see `docs/metrics.md` and the notes they come from):

- ``R`` is a 2-D float array with ``T + 1`` rows. Row 0 is the base model (before any training),
  row ``t`` (1..T) is the model after stage ``t``.
- Columns are the stream's tasks first, in stream order (column ``j - 1`` is trained in stage
  ``j``), then the held-out probes. Every column has a kind: ``stream``, ``ood`` or ``general``.
- Missing cells are NaN. A metric never silently averages around a hole: when a cell it needs is
  NaN its value is ``None`` and the entry names the missing cells.
- Metrics that are undefined for a stream of one stage (BWT, FWT, forgetting all divide by, or
  range over, the ``T - 1`` earlier tasks) are ``None`` with a note saying why.

Published definitions disagree, so each function takes the variant explicitly and
:func:`compute_metrics` records which variant produced every value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

ColumnKind = Literal["stream", "ood", "general"]
BwtVariant = Literal["t_minus_1", "t"]
FwtVariant = Literal["base", "none"]
ForgettingVariant = Literal["max", "diagonal"]

ALL_METRICS = ("acc", "op", "aia", "la", "bwt", "fwt", "forgetting", "ood_delta",
               "general_delta", "intransigence")


class MatrixError(ValueError):
    """The matrix and its column metadata do not fit together."""


@dataclass(frozen=True)
class Column:
    """Metadata of one column of R."""

    name: str
    kind: ColumnKind = "stream"
    higher_is_better: bool = True


class Undefined(Exception):
    """Raised inside a metric when its value does not exist; the message says why."""


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def as_matrix(R: Any) -> np.ndarray:
    """R as a float64 2-D array; ``None`` cells become NaN."""
    if isinstance(R, np.ndarray) and R.dtype != object:
        arr = R.astype(np.float64)
    else:
        arr = np.array([[np.nan if v is None else v for v in row] for row in R], dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1:
        raise MatrixError(f"R must be a 2-D matrix with at least one row, got shape {arr.shape}")
    return arr


def normalise_columns(columns: Sequence[Column | Mapping[str, Any] | Any]) -> list[Column]:
    """Accept :class:`Column`, mappings, or any object with ``name``/``kind`` attributes."""
    out = []
    for c in columns:
        if isinstance(c, Column):
            out.append(c)
            continue
        get = c.get if isinstance(c, Mapping) else (lambda k, d=None, c=c: getattr(c, k, d))
        kind = get("kind", "stream")
        if kind not in ("stream", "ood", "general"):
            raise MatrixError(f"column {get('name')!r}: unknown kind {kind!r} "
                              "(expected stream, ood or general)")
        out.append(Column(name=str(get("name")), kind=kind,
                          higher_is_better=bool(get("higher_is_better", True))))
    return out


def stream_count(columns: Sequence[Column]) -> int:
    """Number of stream columns; they must all come before the probes."""
    kinds = [c.kind for c in columns]
    T = sum(k == "stream" for k in kinds)
    if any(k != "stream" for k in kinds[:T]):
        raise MatrixError("stream columns must come first, in stream order, before the probes")
    return T


def _need(R: np.ndarray, cells: Sequence[tuple[int, int]]) -> None:
    missing = [(i, j) for i, j in cells if np.isnan(R[i, j])]
    if missing:
        shown = ", ".join(f"R[{i}][{j}]" for i, j in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise Undefined(f"missing cells: {shown}{more}")


def _stages(R: np.ndarray) -> int:
    T = R.shape[0] - 1
    if T < 1:
        raise Undefined("no stage has been completed (R has only the base row)")
    return T


# ---------------------------------------------------------------------------------------------
# The metrics. R here holds only the stream columns: shape (T + 1, T); stage t trains column t-1.
# ---------------------------------------------------------------------------------------------

def op_per_stage(R: np.ndarray) -> list[float]:
    """OP_t = (1/t) sum_{j<=t} R[t][j] for t = 1..T (TRACE's "overall performance")."""
    T = _stages(R)
    _need(R, [(t, j) for t in range(1, T + 1) for j in range(t)])
    return [float(np.mean(R[t, :t])) for t in range(1, T + 1)]


def acc(R: np.ndarray) -> float:
    """ACC = (1/T) sum_j R[T][j] over the stream tasks (final average accuracy)."""
    T = _stages(R)
    _need(R, [(T, j) for j in range(T)])
    return float(np.mean(R[T, :T]))


def average_incremental_accuracy(R: np.ndarray) -> float:
    """(1/T) sum_t OP_t."""
    return float(np.mean(op_per_stage(R)))


def learning_accuracy(R: np.ndarray) -> float:
    """LA = (1/T) sum_j R[j][j]: the score on each task right after learning it (plasticity)."""
    T = _stages(R)
    _need(R, [(j, j - 1) for j in range(1, T + 1)])
    return float(np.mean([R[j, j - 1] for j in range(1, T + 1)]))


def bwt(R: np.ndarray, variant: BwtVariant = "t_minus_1") -> float:
    """BWT = (1/N) sum_{j<T} (R[T][j] - R[j][j]); N = T-1 (GEM's paper) or T (GEM's code).

    Undefined for T = 1: there is no earlier task whose retention could be measured (the 1/T
    variant would report a fake 0).
    """
    T = _stages(R)
    if T < 2:
        raise Undefined("needs at least 2 stages (no earlier task to look back on)")
    _need(R, [(T, j - 1) for j in range(1, T)] + [(j, j - 1) for j in range(1, T)])
    total = sum(R[T, j - 1] - R[j, j - 1] for j in range(1, T))
    return float(total / (T - 1 if variant == "t_minus_1" else T))


def fwt(R: np.ndarray, variant: FwtVariant = "base",
        b: Sequence[float] | np.ndarray | None = None) -> float:
    """FWT = (1/(T-1)) sum_{j>=2} (R[j-1][j] - b[j]).

    ``variant="base"``: b is the base model's row R[0] unless ``b`` is given explicitly (e.g. a
    random-init reference as in GEM); ``variant="none"``: b = 0 (CITB). Undefined for T = 1.
    """
    T = _stages(R)
    if T < 2:
        raise Undefined("needs at least 2 stages (no task is seen before it is trained)")
    # R[j-1][j] with 1-based task j is row j-1, 0-based column j-1.
    cells = [(j - 1, j - 1) for j in range(2, T + 1)]
    if variant == "none":
        ref = np.zeros(T)
    elif b is not None:
        ref = np.asarray(b, dtype=np.float64)
        if ref.shape != (T,):
            raise MatrixError(f"b must hold one reference per stream task ({T}), got {ref.shape}")
    else:
        _need(R, [(0, j - 1) for j in range(2, T + 1)])
        ref = R[0, :T]
    _need(R, cells)
    return float(np.mean([R[j - 1, j - 1] - ref[j - 1] for j in range(2, T + 1)]))


def forgetting(R: np.ndarray, variant: ForgettingVariant = "max") -> float:
    """F_T = (1/(T-1)) sum_{j<T} (ref_j - R[T][j]).

    ``max``: ref_j = max over stages l = 1..T-1 of R[l][j] (Chaudhry et al. 2018; the base row
    is not a stage and is excluded). ``diagonal``: ref_j = R[j][j] (Avalanche). Undefined for T=1.
    """
    T = _stages(R)
    if T < 2:
        raise Undefined("needs at least 2 stages (no earlier task can be forgotten)")
    if variant == "max":
        _need(R, [(row, j - 1) for j in range(1, T) for row in range(1, T)] +
              [(T, j - 1) for j in range(1, T)])
        refs = [np.max(R[1:T, j - 1]) for j in range(1, T)]
    else:
        _need(R, [(j, j - 1) for j in range(1, T)] + [(T, j - 1) for j in range(1, T)])
        refs = [R[j, j - 1] for j in range(1, T)]
    return float(np.mean([refs[j - 1] - R[T, j - 1] for j in range(1, T)]))


def intransigence(R: np.ndarray, joint: Sequence[float]) -> list[float]:
    """I_k = a*_k - R[k][k] for each stage k, with a* a jointly trained reference's scores."""
    T = _stages(R)
    ref = np.asarray(joint, dtype=np.float64)
    if ref.shape != (T,):
        raise MatrixError(f"the joint reference must hold one score per stream task ({T}), "
                          f"got {ref.shape}")
    if np.isnan(ref).any():
        raise Undefined("the joint reference has missing scores")
    _need(R, [(k, k - 1) for k in range(1, T + 1)])
    return [float(ref[k - 1] - R[k, k - 1]) for k in range(1, T + 1)]


def probe_delta(R: np.ndarray, probe_columns: Sequence[int],
                higher_is_better: Sequence[bool] | None = None) -> float:
    """(1/N) sum_p (R[T][p] - R[0][p]) over the given probe columns (TRACE's general delta).

    Lower-is-better columns have their delta negated so that a positive value always means the
    final model is better than the base model on that probe.
    """
    T = _stages(R)
    if not probe_columns:
        raise Undefined("the suite has no probe of this kind")
    signs = [1.0 if hib else -1.0 for hib in (higher_is_better or [True] * len(probe_columns))]
    _need(R, [(r, p) for p in probe_columns for r in (0, T)])
    return float(np.mean([s * (R[T, p] - R[0, p]) for p, s in zip(probe_columns, signs)]))


# ---------------------------------------------------------------------------------------------
# All at once, with the variants recorded
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variants:
    """Which published variant each metric uses (mirrors `clbench.spec.schema.MetricVariants`)."""

    bwt: BwtVariant = "t_minus_1"
    fwt: FwtVariant = "base"
    forgetting: ForgettingVariant = "max"


VARIANT_LABELS = {
    "acc": "mean of R[T][j] over stream tasks",
    "op": "OP_t = mean of R[t][j], j <= t, per stage",
    "aia": "mean over stages of OP_t",
    "la": "mean of R[j][j]",
    "bwt": {"t_minus_1": "1/(T-1) normaliser (GEM paper)", "t": "1/T normaliser (GEM code)"},
    "fwt": {"base": "b = base model row R[0]", "none": "no reference (b = 0)"},
    "forgetting": {"max": "max over earlier stages (Chaudhry 2018)",
                   "diagonal": "R[j][j] reference (Avalanche)"},
    "ood_delta": "mean of R[T][p] - R[0][p] over OOD probes",
    "general_delta": "mean of R[T][p] - R[0][p] over general-ability probes",
    "intransigence": "a*_k - R[k][k] against a joint reference",
}


def compute_metrics(R: Any, columns: Sequence[Column | Mapping[str, Any] | Any],
                    protocol: Any = None, *, joint: Sequence[float] | None = None,
                    fwt_reference: Sequence[float] | None = None,
                    metrics: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every requested metric as ``{name: {"value", "variant", ...}}``.

    ``protocol`` may be a `clbench.spec.schema.ProtocolSpec` (its ``metrics`` and ``variants`` are
    used), a :class:`Variants`, or ``None`` (defaults, all metrics). ``joint`` enables
    intransigence; ``fwt_reference`` replaces the base row as FWT's b. ``value`` is ``None``
    when the metric is undefined, with ``note`` saying why. ``op`` and ``intransigence`` also
    carry ``per_stage`` lists.
    """
    full = as_matrix(R)
    cols = normalise_columns(columns)
    if full.shape[1] != len(cols):
        raise MatrixError(f"R has {full.shape[1]} columns but {len(cols)} columns are described")
    T = stream_count(cols)
    if T == 0:
        raise MatrixError("no stream column: a continual run needs at least one stage")
    if full.shape[0] - 1 != T:
        raise MatrixError(f"R has {full.shape[0] - 1} stage rows (plus the base row) but the "
                          f"stream has {T} tasks; pass the complete matrix")
    variants = _variants_of(protocol)
    wanted = list(metrics if metrics is not None else
                  getattr(protocol, "metrics", None) or
                  [m for m in ALL_METRICS if m != "intransigence" or joint is not None])
    stream = full[:, :T]
    ood = [i for i, c in enumerate(cols) if c.kind == "ood"]
    general = [i for i, c in enumerate(cols) if c.kind == "general"]

    def labelled(name: str, fn: Any, variant_key: str | None = None) -> dict[str, Any]:
        label = VARIANT_LABELS[name]
        variant = getattr(variants, variant_key) if variant_key else None
        entry: dict[str, Any] = {"variant": variant if variant else "standard",
                                 "description": label[variant] if variant else label}
        try:
            value = fn()
        except Undefined as why:
            entry.update(value=None, note=str(why))
            return entry
        if isinstance(value, list):
            entry.update(value=float(np.mean(value)), per_stage=value)
        else:
            entry["value"] = value
        return entry

    table = {
        "acc": lambda: labelled("acc", lambda: acc(stream)),
        "op": lambda: labelled("op", lambda: op_per_stage(stream)),
        "aia": lambda: labelled("aia", lambda: average_incremental_accuracy(stream)),
        "la": lambda: labelled("la", lambda: learning_accuracy(stream)),
        "bwt": lambda: labelled("bwt", lambda: bwt(stream, variants.bwt), "bwt"),
        "fwt": lambda: labelled("fwt", lambda: fwt(stream, variants.fwt, fwt_reference), "fwt"),
        "forgetting": lambda: labelled("forgetting",
                                       lambda: forgetting(stream, variants.forgetting),
                                       "forgetting"),
        "ood_delta": lambda: labelled("ood_delta", lambda: probe_delta(
            full, ood, [cols[i].higher_is_better for i in ood])),
        "general_delta": lambda: labelled("general_delta", lambda: probe_delta(
            full, general, [cols[i].higher_is_better for i in general])),
        "intransigence": lambda: labelled("intransigence", lambda: _intransigence(stream, joint)),
    }
    out: dict[str, dict[str, Any]] = {}
    for name in wanted:
        if name not in table:
            raise MatrixError(f"unknown metric {name!r}; known: {', '.join(ALL_METRICS)}")
        out[name] = table[name]()
    if "op" in out and out["op"]["value"] is not None:
        # OP's headline is the final stage's OP (= ACC), the per-stage list is the content.
        out["op"]["value"] = out["op"]["per_stage"][-1]
    return out


def _intransigence(stream: np.ndarray, joint: Sequence[float] | None) -> list[float]:
    if joint is None:
        raise Undefined("needs a joint (multi-task) reference run")
    return intransigence(stream, joint)


def _variants_of(protocol: Any) -> Variants:
    if protocol is None:
        return Variants()
    if isinstance(protocol, Variants):
        return protocol
    v = getattr(protocol, "variants", protocol)
    return Variants(bwt=getattr(v, "bwt", "t_minus_1"), fwt=getattr(v, "fwt", "base"),
                    forgetting=getattr(v, "forgetting", "max"))
