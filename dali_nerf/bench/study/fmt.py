"""How the study's report writes a number: milliseconds, percentages, ratios with their 95%
intervals, regimes by cores per GPU, device steps by name. One place, so that the same number reads
the same in every section, in README's sentence and in BENCHMARKS' row.

>>> ci_x({"speedup": 2.0, "speedup_ci": [1.5, 2.5]}, "speedup"), cpg({"cores_per_gpu": 1.0})
('2.00x [1.50, 2.50]', '1 core per GPU')
"""

from __future__ import annotations

from typing import Optional

__all__ = ["fmt_ms", "pct", "num", "ci_ms", "ci_pct", "ci_x", "gpus", "cpg", "step_label", "holds_one"]


def fmt_ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3g}"


def ci_ms(c: dict, key: str = "step") -> str:
    lo, hi = c[f"{key}_ci"]
    return f"{c[f'{key}_s'] * 1e3:.2f} [{lo * 1e3:.2f}, {hi * 1e3:.2f}]"


def ci_pct(c: dict) -> str:
    lo, hi = c["stall_ci"]
    return f"{100 * c['stall']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def ci_x(x: dict, key: str) -> str:
    """``2.00x [1.50, 2.50]``: a ratio and its 95% interval (``-`` where it was not measured)."""
    if x.get(key) is None:
        return "-"
    lo, hi = x[f"{key}_ci"]
    return f"{x[key]:.2f}x [{lo:.2f}, {hi:.2f}]"


def holds_one(x: dict, key: str) -> bool:
    """Whether the 95% interval of ratio ``key`` holds 1.0 (no effect shown)."""
    lo, hi = x[f"{key}_ci"]
    return lo <= 1.0 <= hi


def gpus(n: int) -> str:
    return f"{n} emulated GPU" + ("s" if n != 1 else "")


def cpg(x: dict) -> str:
    """``2 cores per GPU`` (or ``0.125 core per GPU``) of a row or pair."""
    v = x.get("cores_per_gpu")
    return "-" if v is None else f"{v:.3g} core{'s' if v > 1 else ''} per GPU"


def step_label(x: dict) -> str:
    """A row's device step: ``measured 9.29 ms`` (its name and its ms at the row's rays)."""
    ms = x.get("emulated_step_ms")
    ms_s = "-" if ms is None else f"{ms:.3g} ms"
    return f"{x['step_name']} {ms_s}" if x.get("step_name") else ms_s
