"""The study's statistics: the 95% t-interval of a mean, and of a geometric mean (ratios of steps).

>>> mean_ci([1.0, 2.0, 3.0])[0], round(gmean_ci([1.2, 1.5, 1.8])[0], 4)
(2.0, 1.4812)
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dali_nerf.errors import DaliNerfError

__all__ = ["mean_ci", "gmean_ci", "gmean"]

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def mean_ci(xs: Sequence[float]) -> tuple:
    """(mean, [lo, hi]): the 95% t-interval of the mean (Student's t, n - 1 degrees of freedom);
    one value: [x, x] (no interval can be given: the report says n = 1)."""
    x = np.asarray([v for v in xs if v is not None and math.isfinite(v)], np.float64)
    if x.size == 0:
        return float("nan"), [float("nan"), float("nan")]
    m = float(x.mean())
    if x.size == 1:
        return m, [m, m]
    t = _T975[x.size - 2] if x.size - 1 <= len(_T975) else 1.96
    h = t * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, [m - h, m + h]


def gmean_ci(xs: Sequence[float]) -> tuple:
    """(geometric mean, [lo, hi]) of positive ratios ``xs``: :func:`mean_ci` of their logs, back
    through exp (a 95% interval for the geometric mean, not symmetric about it). The geometric mean
    of per-trial products is the product of the geometric means, so a speedup's two gains multiply
    to it over trials as they do in each trial.

    >>> round(gmean_ci([1.2, 1.5, 1.8])[0] ** 3, 6) == round(1.2 * 1.5 * 1.8, 6)
    True
    """
    x = [v for v in xs if v is not None and math.isfinite(v)]
    if any(v <= 0 for v in x):
        raise DaliNerfError(f"gmean_ci: ratios must be positive, got {x} (a step time of 0 in a metrics file?)")
    m, (lo, hi) = mean_ci([math.log(v) for v in x])
    return math.exp(m), [math.exp(lo), math.exp(hi)]


def gmean(xs: Sequence[float]) -> float:
    """The geometric mean of positive ratios ``xs`` (one trial's pairs)."""
    return float(np.exp(np.mean(np.log(np.asarray(xs, np.float64)))))
