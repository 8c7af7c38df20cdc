"""Refit the study's cost model on a saved report's measurements, with the current model code.

    python benchmarks/refit_cost_model.py DERIVED_JSON [--config study]

e.g. a report of an earlier commit:
    git show f3ad8d7:docs/study/cpu-2core-x86_64/derived.json > /tmp/derived.json
    python benchmarks/refit_cost_model.py /tmp/derived.json

Reads the runs and the sampling timings that ``dali-nerf bench study`` kept in derived.json, fits and
checks the model as the study does (:func:`dali_nerf.bench.study.fit_and_check`: ``bench.fit_ranks``
and ``bench.allreduce_latency_s`` of ``--config``, this host's core count) and prints the fit and
check sets' step-time errors, overall and per sampler. On the derived.json of the report made with
the same code it prints the report's own figures; on an older one it shows what a model change does
to the same measurements (a report before format 4 gave device steps in ms per 4096 rays: converted
to the ms of each row's step).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main(argv=None) -> None:
    from dali_nerf.bench import costmodel as cm
    from dali_nerf.bench.study import fit_and_check, sampling_profile
    from dali_nerf.config import load_config
    from dali_nerf.bench.study.provenance import host_cores

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("derived", help="a study's derived.json")
    ap.add_argument("--config", default="study")
    a = ap.parse_args(argv)
    raw = json.load(open(a.derived))
    if int(raw["meta"].get("format", 1)) < 4:  # device steps were ms per 4096 rays then: the ms of the row's step now
        for r in raw["derived"]["runs"]:
            if r.get("emulated_step_ms") is not None:
                r["emulated_step_ms"] *= r["rays_per_rank"] / 4096
    sampling = dict(raw["sampling"], profile=sampling_profile(raw["sampling"], host_cores()))
    b = load_config(a.config, check_paths=False).bench
    _, rows, desc = fit_and_check(raw["derived"], b, raw["meta"]["rays"], raw["cost_model"]["grad_bytes"], sampling,
                                  host_cores())
    print(f"{a.derived} (commit {raw['meta']['commit'][:12]}); fit: {desc}")
    for name in ("fit", "check"):
        errs = {s: [abs(r["step_error"]) for r in rows if r["set"] == name and r["sampler"] == s] for s in cm.SAMPLERS}
        every = [e for v in errs.values() for e in v]
        if every:
            print(f"{name} set: mean absolute step-time error {100 * np.mean(every):.1f}%, max {100 * np.max(every):.1f}% "
                  f"over {len(every)} configurations (" + "; ".join(
                      f"{s}: mean {100 * np.mean(v):.1f}%, max {100 * np.max(v):.1f}%" for s, v in errs.items() if v) + ")")


if __name__ == "__main__":
    main()
