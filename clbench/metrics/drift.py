"""Parameter drift: how far training moved a model's weight matrices, as pure functions.

For one 2-D weight matrix, W0 before and W1 after (the base model's, or the previous stage's):

- **normalised spectral shift** NSS = ||sigma(W1) - sigma(W0)||_2 / ||sigma(W0)||_2, sigma the
  singular values in decreasing order;
- **largest principal angle** (degrees) between the top-k left singular subspaces of W0 and W1,
  and between their top-k right ones: the cosines of the principal angles between two k-frames
  are the singular values of U0_k^T U1_k, their sines those of (I - U0_k U0_k^T) U1_k; the
  largest angle is computed from the largest sine (accurate for small angles);
- **changed fraction**: the share of entries with |W1 - W0| > rtol * max(|W0|, |W1|) (the
  paper's update mask, rtol 1e-3);
- **principal-mask overlap**: the principal mask of W is the `mask_fraction` of its entries that
  are largest in magnitude in its rank-k reconstruction U_k diag(sigma_k) V_k^T; the overlap is
  |M0 & M1| / |M0 | M1| (Jaccard: 1 when the same entries carry the principal structure, 0 when
  none do). The paper's exact form is not public; this is clbench's, and is named so in results.

Everything is computed in float64 (block by block of rows where a whole matrix would be a large
copy; the mask's ranking in float32). For a matrix whose smaller side is at most `exact_limit`,
the singular values and top-k vectors come from the eigendecomposition of its Gram matrix
(:func:`_exact_top_k`: on the embedded model 1.6x faster than the singular values alone by SVD,
and per matrix within 5e-10 of their NSS); otherwise the singular values come from `svdvals`
and the vectors from a randomised rank-(k + oversampling) SVD with power iterations
(`torch.svd_lowrank`, seeded). On the embedded model (all sides
<= 576) everything is exact: the randomised path saved little there (the exact singular values
and the masks cost as much) and moved the largest angle by up to a third where the k-th and
(k+1)-th singular values are close (docs/metrics.md, benchmarks/diagnostics_cost.py).
:func:`model_drift` aggregates the matrices by kind (attention, MLP, embeddings, other) and over
all of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Name fragments that say which kind of layer a weight matrix belongs to (Hugging Face names).
KINDS = {
    "embeddings": ("embed", "wte", "wpe", "lm_head", "word_embeddings", "shared"),
    "attention": ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj", "qkv",
                  "query", "key", "value", "c_attn"),
    "mlp": ("mlp", "feed_forward", "ffn", "gate_proj", "up_proj", "down_proj", "fc1", "fc2",
            "c_fc", "dense_h_to_4h", "dense_4h_to_h"),
}


@dataclass(frozen=True)
class DriftSettings:
    """What the drift of a matrix is measured with (a suite's protocol sets them)."""

    k: int = 16                   # singular directions of the subspaces and the mask
    rtol: float = 1e-3            # relative tolerance of the changed fraction
    mask_fraction: float = 0.1    # share of entries in a principal mask
    exact_limit: int = 4096       # larger smaller-side: randomised subspaces (see below)
    oversampling: int = 8
    power_iterations: int = 4


@dataclass(frozen=True)
class MatrixDrift:
    """The drift of one matrix (see the module docstring)."""

    nss: float
    left_angle: float        # degrees
    right_angle: float       # degrees
    changed_fraction: float
    mask_overlap: float
    parameters: int

    @property
    def max_angle(self) -> float:
        return max(self.left_angle, self.right_angle)


def layer_kind(name: str) -> str:
    """`embeddings`, `attention`, `mlp` or `other`, from a parameter's name."""
    lowered = name.lower()
    for kind, fragments in KINDS.items():
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def nss(sigma0: torch.Tensor, sigma1: torch.Tensor) -> float:
    """||sigma1 - sigma0|| / ||sigma0|| of two vectors of singular values (decreasing)."""
    base = float(torch.linalg.vector_norm(sigma0))
    if base == 0.0:
        return 0.0 if float(torch.linalg.vector_norm(sigma1)) == 0.0 else math.inf
    return float(torch.linalg.vector_norm(sigma1 - sigma0)) / base


def max_principal_angle(frame0: torch.Tensor, frame1: torch.Tensor) -> float:
    """The largest principal angle (degrees) between the column spaces of two orthonormal
    frames of the same shape. Its sine is the largest singular value of the part of `frame1`
    outside the span of `frame0` (accurate for the small angles training gives, where the
    arccos of the cosines is not: a cosine of 1 - 1e-16 is already 1e-6 degrees)."""
    if frame1.numel() == 0:
        return 0.0
    outside = frame1 - frame0 @ (frame0.T @ frame1)
    sine = float(torch.linalg.matrix_norm(outside, ord=2).clamp(0.0, 1.0))
    return math.degrees(math.asin(sine))


#: Rows per block where a whole matrix in float64 would be a large transient copy (the embedded
#: model's embedding matrix is 226 MB in float64): blocks bound the diagnostics' peak memory.
BLOCK_ROWS = 4096


def _row_blocks(rows: int) -> Iterable[slice]:
    return (slice(start, min(start + BLOCK_ROWS, rows)) for start in range(0, rows, BLOCK_ROWS))


def changed_fraction(w0: torch.Tensor, w1: torch.Tensor, rtol: float) -> float:
    """Share of entries with |w1 - w0| > rtol * max(|w0|, |w1|) (in float64, block by block)."""
    changed = 0
    for rows in _row_blocks(w0.shape[0]):
        a, b = w0[rows].to(torch.float64), w1[rows].to(torch.float64)
        changed += int(((b - a).abs() > rtol * torch.maximum(a.abs(), b.abs())).sum())
    return changed / max(w0.numel(), 1)


def principal_mask(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor, fraction: float
                   ) -> torch.Tensor:
    """The mask of the `fraction` largest-magnitude entries of the reconstruction
    u diag(s) v^T (at least one entry; entries tied with the last one all in), as packed bits
    (uint8, eight entries a byte: a profile is kept between stages, and a byte per entry was
    135 MB a side on the embedded model). The reconstruction is computed in float64 block by
    block and ranked in float32 (ties at the threshold aside, the same entries); the threshold
    is found by partitioning, not sorting (a top-k selection of the embedding matrix's 2.8
    million entries took 5x as long)."""
    import numpy as np

    magnitude = torch.empty(u.shape[0], v.shape[0], dtype=torch.float32)
    scaled = u * s
    for rows in _row_blocks(u.shape[0]):
        magnitude[rows] = (scaled[rows] @ v.T).abs()
    flat = magnitude.flatten().numpy()
    last = flat.size - max(1, round(fraction * flat.size))  # the smallest entry kept, ranked
    threshold = np.partition(flat, last)[last]
    return torch.from_numpy(np.packbits(flat >= threshold))


@functools.cache
def _popcount() -> Any:
    """The number of set bits of each byte value (a lookup table)."""
    import numpy as np

    return np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1)


def _bits(packed: torch.Tensor) -> int:
    """How many bits are set in a packed mask."""
    return int(_popcount()[packed.numpy()].sum())


@dataclass(frozen=True)
class Profile:
    """What the drift of a matrix needs of one side besides its entries: every singular value,
    the top-k singular triplets and the principal mask (computed once, compared often)."""

    sigma: torch.Tensor   # all singular values, decreasing (float64)
    u: torch.Tensor       # [m, k]
    s: torch.Tensor       # [k]
    v: torch.Tensor       # [n, k]
    mask: torch.Tensor    # [ceil(m * n / 8)] uint8: the principal mask, packed bits


def profile(w: torch.Tensor, settings: DriftSettings = DriftSettings()) -> Profile:
    """The :class:`Profile` of `w`, exact or randomised (see the module docstring)."""
    w = w.detach()
    k = min(settings.k, *w.shape)
    if min(w.shape) <= settings.exact_limit:
        u, sigma_k, v, sigma = _exact_top_k(w, k)
    else:
        w = w.to(torch.float64)
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(0)  # the same sketch every time: drift must not depend on the RNG
        try:
            u, sigma_k, v = torch.svd_lowrank(w, q=min(k + settings.oversampling, *w.shape),
                                              niter=settings.power_iterations)
        finally:
            torch.random.set_rng_state(generator_state)
        u, sigma_k, v = u[:, :k].clone(), sigma_k[:k].clone(), v[:, :k].clone()
        sigma = torch.linalg.svdvals(w)
    return Profile(sigma, u, sigma_k, v, principal_mask(u, sigma_k, v, settings.mask_fraction))


def _exact_top_k(w: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U_k, sigma_k, V_k, every sigma) of a matrix, in float64, from the eigendecomposition of
    its Gram matrix on the smaller side: 3-5x faster than an SVD on the embedded model's
    matrices, singular values within 1e-13 of the SVD's relative to the largest. The Gram matrix
    and the long side's vectors are accumulated block by block of the long side (no float64 copy
    of the whole matrix). A matrix with a top-k singular value near zero (rank below k) takes the
    SVD: its directions are not defined by the Gram matrix."""
    tall = w.shape[0] >= w.shape[1]
    long = w if tall else w.T  # rows: the long side
    gram = torch.zeros(long.shape[1], long.shape[1], dtype=torch.float64)
    for rows in _row_blocks(long.shape[0]):
        block = long[rows].to(torch.float64)
        gram += block.T @ block
    eigenvalues, vectors = torch.linalg.eigh(gram)
    sigma = eigenvalues.flip(0).clamp(min=0.0).sqrt()
    if sigma[0] > 0 and bool((sigma[:k] > 1e-6 * sigma[0]).all()):
        frame = vectors.flip(1)[:, :k].clone()  # a clone: a view would keep all of `vectors`
        top = sigma[:k].clone()
        other = torch.cat([long[rows].to(torch.float64) @ frame
                           for rows in _row_blocks(long.shape[0])]) / top
        return (other, top, frame, sigma) if tall else (frame, top, other, sigma)
    u, s, vh = torch.linalg.svd(w.to(torch.float64), full_matrices=False)
    return u[:, :k].clone(), s[:k].clone(), vh[:k].T.clone(), s


def drift_between(w0: torch.Tensor, p0: Profile, w1: torch.Tensor, p1: Profile,
                  settings: DriftSettings = DriftSettings()) -> MatrixDrift:
    """The drift from `w0` to `w1` given their profiles (computed once, compared often)."""
    if w0.shape != w1.shape or w0.dim() != 2:
        raise ValueError(f"drift compares two matrices of one shape, got {tuple(w0.shape)} and "
                         f"{tuple(w1.shape)}")
    union = _bits(p0.mask | p1.mask)
    overlap = _bits(p0.mask & p1.mask) / union if union else 1.0
    return MatrixDrift(nss=nss(p0.sigma, p1.sigma), left_angle=max_principal_angle(p0.u, p1.u),
                       right_angle=max_principal_angle(p0.v, p1.v),
                       changed_fraction=changed_fraction(w0.detach(), w1.detach(),
                                                         settings.rtol),
                       mask_overlap=overlap, parameters=w0.numel())


def matrix_drift(w0: torch.Tensor, w1: torch.Tensor, settings: DriftSettings = DriftSettings()
                 ) -> MatrixDrift:
    """The drift of one matrix from `w0` to `w1` (same shape)."""
    if w0.shape != w1.shape or w0.dim() != 2:
        raise ValueError(f"drift compares two matrices of one shape, got {tuple(w0.shape)} and "
                         f"{tuple(w1.shape)}")
    return drift_between(w0, profile(w0, settings), w1, profile(w1, settings), settings)


def weight_matrices(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The 2-D weights among named parameters (tied copies counted once, by storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named:
        if tensor.dim() != 2:
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def summarise(drifts: Mapping[str, MatrixDrift]) -> dict[str, dict[str, float]]:
    """Per kind and `all`: NSS, changed fraction and mask overlap averaged over the matrices
    weighted by their parameters, the largest principal angle, and the matrix count."""
    groups: dict[str, list[MatrixDrift]] = {}
    for name, drift in drifts.items():
        groups.setdefault(layer_kind(name), []).append(drift)
    groups["all"] = list(drifts.values())
    out = {}
    for kind, items in groups.items():
        if not items:
            continue
        total = sum(d.parameters for d in items)
        mean = {field: sum(getattr(d, field) * d.parameters for d in items) / total
                for field in ("nss", "changed_fraction", "mask_overlap")}
        out[kind] = {**mean, "max_principal_angle": max(d.max_angle for d in items),
                     "matrices": float(len(items))}
    return out


def model_drift(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor],
                settings: DriftSettings = DriftSettings()) -> dict[str, dict[str, float]]:
    """:func:`summarise` of every 2-D weight present in both (by name, with equal shapes)."""
    drifts = {name: matrix_drift(before[name], w, settings) for name, w in after.items()
              if name in before and before[name].shape == w.shape and w.dim() == 2}
    return summarise(drifts)

