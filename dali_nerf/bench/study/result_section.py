"""The report's Result section (what ``dali-nerf bench study`` prints too) and the study in one
sentence (README's): the headline, by a rule fixed before the study runs, with its intervals and
where they hold 1.0; the like-for-like regimes; the small scene's cache row; the starved host and
the rows that do not keep up. Every number comes from :func:`~dali_nerf.bench.study.summary.derive_summary`.

>>> print("\n".join(result(derived["summary"], emu, derived["speedups"], meta)))
>>> headline_sentence(derived["summary"], meta)
"""

from __future__ import annotations

from typing import List, Optional

from dali_nerf.train.emulation import EMULATED_LABEL
from dali_nerf.bench.study.fmt import ci_x, cpg, fmt_ms, gpus, holds_one, num, pct, step_label
from dali_nerf.bench.study.rules import BAND, KEEPS_UP_STALL, PAPER, keeps_up, keeps_up_reason, starved

__all__ = ["result", "headline_sentence", "regime_table"]


def _ms_range(rows: List[dict]) -> str:
    ms = sorted({r["emulated_step_ms"] for r in rows})
    return f"{ms[0]:.3g} ms" if len(ms) == 1 else f"{ms[0]:.3g}-{ms[-1]:.3g} ms"


def _clause(r: dict, several: bool) -> str:
    """One headline row in the sentence: where (when the rows differ in GPUs), the speedup as the
    product of its two gains, the overlap gain beyond the control's own cost, a flag."""
    where = (f"{r['ranks']} GPUs ({cpg(r)}), " if several else "") + f"{r['rays_per_rank']} rays per GPU"
    beyond = "" if r.get("overlap_beyond") is None else f" ({r['overlap_beyond']:.2f}x beyond the control's own cost)"
    flag = f" (flagged: {'; '.join(r['flags'])})" if r.get("flags") else ""
    return (f"at {where}, speedup {ci_x(r, 'speedup')} = sampler gain {ci_x(r, 'sampler_gain')} x overlap gain "
            f"{ci_x(r, 'overlap_gain')}{beyond}{flag}")


def headline_sentence(s: dict, meta: dict) -> Optional[str]:
    """The study in one sentence (README's): the headline's regime (fixed by rule), each of its rows'
    speedup as sampler gain x overlap gain with 95% intervals, and where the overlap gain's interval
    holds 1.0; None when no row meets the rule."""
    h = (s or {}).get("headline") or {}
    rows = h.get("rows") or []
    if not rows:
        return None
    ranks = sorted({r["ranks"] for r in rows})
    several = len(ranks) > 1
    where = (f"{gpus(ranks[0])} at {cpg(rows[0])}" if not several
             else f"{ranks[0]}-{ranks[-1]} emulated GPUs on {rows[0]['cores']} cores")
    cpu = f" ({meta['cpu']})" if meta.get("cpu") else ""
    one = [r for r in rows if r.get("overlap_gain") is not None and holds_one(r, "overlap_gain")]
    held = ""
    if one:
        at = ", ".join((f"{r['ranks']} GPUs and " if several else "") + str(r["rays_per_rank"]) for r in one)
        held = (f" The overlap gain's 95% interval holds 1.0 at {at} rays per GPU: there the study shows no "
                f"overlap gain.")
    return (f"On {meta['machine']}{cpu}, {where} (DDP, device step {rows[0]['step_name'] or '-'}: "
            f"{_ms_range(rows)}; {EMULATED_LABEL}), pipelined sampling against the ISPASS study's synchronous global "
            f"sampler: " + "; ".join(_clause(r, several) for r in rows) + "." + held)


def regime_table(rs: List[dict]) -> List[str]:
    """Like-for-like (or headline) rows as a table: where, the device step, the three stalls, the hidden
    stall and the pipelined step over its floor, the speedup, its two gains and the control's own factor."""
    L = ["| method | cores per GPU | GPUs on cores | device step | rays/GPU | stall sync_global | stall rays_sync | "
         "stall rays | hidden | rays step / floor | speedup | sampler gain | overlap gain | control's own cost ms | "
         "control factor | overlap beyond the control | flags |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        L.append(f"| {r['method']} | {r['cores_per_gpu']:.3g} | {r['ranks']} on {r['cores']} | {step_label(r)} | "
                 f"{r['rays_per_rank']} | {pct(r['stall_baseline'])} | {pct(r.get('stall_rays_sync'))} | "
                 f"{pct(r['stall_pipelined'])} | {pct(r.get('hidden_stall'))} | {num(r.get('pipelined_over_floor'))} | "
                 f"{ci_x(r, 'speedup')} | {ci_x(r, 'sampler_gain')} | {ci_x(r, 'overlap_gain')} | "
                 f"{fmt_ms(r.get('control_cost_s'))} | {ci_x(r, 'control_factor')} | {ci_x(r, 'overlap_beyond')} | "
                 f"{'; '.join(r.get('flags') or []) or '-'} |")
    return L


def _headline(s: dict, meta: dict) -> List[str]:
    h = (s or {}).get("headline") or {}
    L = [f"**Headline**, by a rule fixed before the study ran (not chosen by its result): {h.get('rule', '-')}.", ""]
    sentence = headline_sentence(s, meta)
    if not sentence:
        return L + ["No regime of this study meets the rule (it needs a DDP launch of at least 2 emulated GPUs on "
                    "every usable core with at least 1 core per GPU).", ""]
    return L + [f"In one sentence: {sentence}", ""] + regime_table(h["rows"]) + [
        "", "control's own cost: what rays_sync pays per step and the pipelined loader does not (the copy out of "
            "DALI's reused buffers and the synchronous executor), measured apart (Sampler throughput section); "
            "control factor = rays_sync step / (rays_sync step - that cost); overlap beyond the control = overlap "
            "gain / control factor: the overlap gain had the control done the pipelined loader's own work.", ""]


def _like_for_like(s: dict) -> List[str]:
    lf = (s or {}).get("like_for_like")
    if not lf:
        return []
    L = ["Like for like with the ISPASS study (its setting, sync_global: rank 0 samples every GPU's batch in the "
         "training thread; rays_sync: our sampler, synchronous in the training thread; rays: our sampler, "
         "pipelined). Sampler gain = sync_global step / rays_sync step (a faster sampler), overlap gain = "
         f"rays_sync step / rays step (overlap: the ISPASS study's effect, {PAPER['speedup_mean']}x on average, "
         f"{PAPER['speedup_max']}x at most); the stall = wait / step (the ISPASS study: input sampling up to "
         f"{100 * PAPER['stall']:.1f}% of training time). Every like-for-like regime (>= 1 core per GPU, not "
         "flagged; 95% intervals over trials; hidden: the pipelined step lost outside next()):", ""]
    L += regime_table(lf["regimes"]) + [""]
    L += [f"Over these {len(lf['regimes'])} regimes the overlap gain is {lf['overlap_gain_mean']:.2f}x on average, "
          f"{lf['overlap_gain_max']:.2f}x at most (the ISPASS study: {PAPER['speedup_mean']}x on average, "
          f"{PAPER['speedup_max']}x at most); the overlap plot below shows each with its interval.", ""]
    c = s.get("comparable")
    if c:
        L += [f"Over the {c['pairs']} comparable pairs (every baseline: sync_global, sync_local, torch_workers; "
              f"emulated, >= 1 core per GPU, not flagged, of the main grid): speedup {c['mean_speedup']:.2f}x on "
              f"average ({c['max_speedup']:.2f}x at most), sampler gain {c['mean_sampler_gain']:.2f}x on average.", ""]
    return L


def _cache(s: dict, meta: dict) -> List[str]:
    rows = (s or {}).get("cache") or []
    if not rows:
        return []
    sc = meta.get("scenes") or {}
    L = [f"Cache effect: the same configuration on the small scene ({sc.get('small', '-')}) and on the main scene "
         f"({sc.get('main', '-')}); the host's last-level cache: {meta.get('l3') or 'not known'}.", "",
         "| scene | GPUs on cores | device step | rays/GPU | stall sync_global | stall rays_sync | stall rays | "
         "sync_global step ms | rays_sync step ms | speedup | sampler gain | overlap gain |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pair in rows:
        for name, r in (("small", pair["small"]), ("main", pair["main"])):
            if r is None:
                L.append("| main | (not run in the main grid) | | | | | | | | | | |")
                continue
            L.append(f"| {name} | {r['ranks']} on {r['cores']} | {step_label(r)} | {r['rays_per_rank']} | "
                     f"{pct(r['stall_baseline'])} | {pct(r.get('stall_rays_sync'))} | {pct(r['stall_pipelined'])} | "
                     f"{fmt_ms(r.get('step_baseline_s'))} | {fmt_ms(r.get('step_rays_sync_s'))} | {ci_x(r, 'speedup')} | "
                     f"{ci_x(r, 'sampler_gain')} | {ci_x(r, 'overlap_gain')} |")
    return L + [""]


def _starved_lines(s: dict, emu: List[dict]) -> List[str]:
    """The starved host in one paragraph, and the rows whose host does not keep up."""
    L = []
    st = (s or {}).get("starved")
    low = [c for c in emu if starved(c)]
    if st and low:
        g = [c for c in low if c["sampler"] == "sync_global"]
        lo, hi = min(c["ranks"] for c in low), max(c["ranks"] for c in low)
        L += [f"Starved host (< 1 core per GPU: {lo if lo == hi else f'{lo}-{hi}'} emulated GPUs on "
              f"{max(c['cores'] for c in low)} cores; not compared with the ISPASS study): "
              + (f"sync_global stall up to {100 * max(c['stall'] for c in g):.1f}%, " if g else "")
              + f"pipelined step up to {st['max_step_over_floor']:.2f}x its floor, hidden stall up to "
              f"{100 * st['max_hidden_stall']:.1f}% of the step (lost outside next(), which the stall does not see).",
              ""]
    bad = [c for c in emu if keeps_up(c) is False]
    if bad:
        L += [f"The pipelined CPU sampler does not keep up (step > {BAND[1]:g}x the floor or stall > "
              f"{100 * KEEPS_UP_STALL:g}%) at: "
              + "; ".join(f"{c['method'].upper()} {gpus(c['ranks'])} at {cpg(c)}, {step_label(c)}, "
                          f"{c['rays_per_rank']} rays" + (", small scene" if c.get("grid") == "cache" else "")
                          + f" ({keeps_up_reason(c)})" for c in bad) + ".", ""]
    return L


def result(s: dict, emu: List[dict], sps: List[dict], meta: dict) -> List[str]:
    """The result: the headline (its rule, sentence and rows), the like-for-like regimes at >= 1 core
    per GPU (its setting, sync_global, split into the sampler gain and the overlap gain, and the
    control's own factor), the cache row, the starved host, the rows that do not keep up and the
    flags (``s``: :func:`~dali_nerf.bench.study.summary.derive_summary`)."""
    L = ["## Result", ""]
    if emu:
        L += [f"Emulated rows: {EMULATED_LABEL}. Regimes are named by cores per GPU: the cores a launch's ranks ran "
              f"on (CPU affinity) over its emulated GPUs; GPU servers give each GPU 8-14. Below 1 core per GPU the "
              f"host is starved: no GPU server is, so those rows are measured and listed but never set beside the "
              f"ISPASS study. Device steps are named by what they stand for (the header lists each with its "
              f"source). No flagged pair is quoted in this section but a headline row, which the rule fixes, and "
              f"which then says so.", ""]
    L += _headline(s, meta) + _like_for_like(s) + _cache(s, meta) + _starved_lines(s, emu)
    if s and s.get("pairs"):
        L += [f"Over all {s['pairs']} pairs (CPU and emulated, the control's included): baseline stall "
              f"{100 * s['mean_stall_sync']:.1f}% on average (max {100 * s['max_stall_sync']:.1f}%), pipelined stall "
              f"at most {100 * s['max_stall_pipelined']:.1f}%; {s['flagged_pairs']} of {s['pairs']} pairs flagged "
              f"(pipelined step outside [1/{BAND[1]:g}, {BAND[1]:g}] x its floor, the threshold of \"keeps up\" too, "
              f"or the other rules of the speedup table; causes there).", ""]
    return L
