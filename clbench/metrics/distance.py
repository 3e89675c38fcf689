"""How far apart two prompt sets are: the maximum mean discrepancy between their embeddings.

MMD^2 (Gretton et al. 2012) with a Gaussian (RBF) kernel k(x, y) = exp(-||x - y||^2 / (2 h^2)),
unbiased estimator (the diagonal of each within-set sum left out), and h from the median
heuristic: the median distance between all pairs of the pooled points. :func:`mmd` reports
sqrt(max(MMD^2, 0)): 0 for sets drawn from one distribution (up to sampling noise), growing as
they separate. Used to place each stage's training prompts against each column's evaluation
prompts, so a report can plot a column's gain or forgetting against its distance.
"""

from __future__ import annotations

import math

import torch


def median_bandwidth(x: torch.Tensor, y: torch.Tensor) -> float:
    """The median pairwise distance of the pooled points (1 when all coincide)."""
    pooled = torch.cat([x, y]).double()
    distances = torch.cdist(pooled, pooled)
    upper = distances[torch.triu(torch.ones_like(distances, dtype=torch.bool), diagonal=1)]
    median = float(upper.median()) if upper.numel() else 0.0
    return median if median > 0 else 1.0


def mmd_squared(x: torch.Tensor, y: torch.Tensor, bandwidth: float | None = None) -> float:
    """Unbiased MMD^2 between the rows of `x` ``[m, d]`` and `y` ``[n, d]`` (m, n >= 2)."""
    if x.shape[0] < 2 or y.shape[0] < 2:
        raise ValueError("MMD needs at least two points on each side")
    h = bandwidth if bandwidth is not None else median_bandwidth(x, y)
    x, y = x.double(), y.double()

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b).pow(2) / (2 * h * h))

    m, n = x.shape[0], y.shape[0]
    kxx, kyy, kxy = kernel(x, x), kernel(y, y), kernel(x, y)
    within_x = (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
    within_y = (kyy.sum() - kyy.diagonal().sum()) / (n * (n - 1))
    return float(within_x + within_y - 2 * kxy.mean())


def mmd(x: torch.Tensor, y: torch.Tensor, bandwidth: float | None = None) -> float:
    """sqrt(max(MMD^2, 0)) between the two point sets (see the module docstring)."""
    return math.sqrt(max(mmd_squared(x, y, bandwidth), 0.0))
