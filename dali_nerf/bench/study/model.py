"""The study's cost model (:mod:`dali_nerf.bench.costmodel`) on its measurements: observations from
the derived configurations, the sampling profile from the sampling micro-benchmark, and the fit on
one set of runs checked on the others.

>>> model, rows, desc = fit_and_check(derive(dirs), cfg.bench, 4096, grad_bytes, sampling, cores=2)
"""

from __future__ import annotations

from typing import List, Optional

from dali_nerf.train.emulation import RAY_FLOATS, DeviceLinks
from dali_nerf.bench import costmodel as cm

__all__ = ["observations", "sampling_profile", "fit_and_check"]


def observations(derived: dict, cores: int, device: Optional[str] = None) -> List[cm.Observation]:
    """Cost-model observations from :func:`derive`'s configurations (optionally one ``device``).

    Cores: the row's own (the cores its ranks ran on: ``cores``, recorded by the study), else
    ``cores`` (the study host's usable cores). Cores per rank: CPU rows: train.torch_threads, else
    cores // ranks as the trainer sets it; emulated rows: min(sampler threads, cores / ranks) (the
    ranks share the host's cores), except sync_global, where rank 0 samples every rank's batch
    while the others wait for it (idle in the scatter's barrier), so its threads have the host to
    themselves: min(sampler threads, cores)."""
    out = []
    for r in derived["runs"]:
        if r["sampler"] not in cm.SAMPLERS or (device is not None and r["device"] != device):
            continue
        n = r.get("cores") or cores
        if r["device"] == "emulated":
            share = n if r["sampler"] == "sync_global" else n / r["ranks"]
            c = min(float(r.get("sampler_threads") or 1), share)
        else:
            c = r.get("torch_threads") or max(1, n // r["ranks"])
        out.append(cm.Observation(r["method"], r["sampler"], r["ranks"], r["rays_per_rank"], c,
                                  r["phases_s"]["wait"], r["compute_s"], r["phases_s"]["sync"], r["step_s"]))
    return out


def sampling_profile(sampling: dict, cores: int) -> cm.SamplingProfile:
    """The cost model's per-core sampling costs from :func:`measure_sampling`'s timings (also as
    derived.json keeps them: "sizes", "sync_s", "loader_s", "sync_cores", "loader_cores")."""
    s0, ks = cm.fit_linear(sampling["sizes"], sampling["sync_s"])
    p0, kp = cm.fit_linear(sampling["sizes"], sampling["loader_s"])
    return cm.SamplingProfile(s0, ks * sampling["sync_cores"], p0, kp * sampling["loader_cores"], cores)


def fit_and_check(derived: dict, b, rays: int, grad_bytes: int, sampling: Optional[dict], cores: int,
                  links: Optional[DeviceLinks] = None):
    """The cost model fit on one set of runs, checked on the others.

    Emulated DDP rows present: fit on ``bench.fit_ranks`` at ``rays`` rays per rank, check on the
    other world sizes and batch sizes (the small scene's cache row left out). Their device compute is
    known by construction (the step's device time at its rays and the host-to-device copy), so predictions take it as given and the model answers for
    the host side: the wait and the sync. Else (CPU rows only) fit and check on the CPU DDP rows,
    in sample, said so. ``cores``: the study host's usable cores (for rows that do not record
    theirs). Returns (model, validation rows with "set" fit | check, description)."""
    links = links or DeviceLinks()
    emu_rows = [c for c in derived["runs"] if c["device"] == "emulated" and c["method"] == "ddp"
                and c["sampler"] in cm.SAMPLERS and (c.get("grid") or "main") != "cache"]
    if emu_rows:
        obs = observations({"runs": emu_rows}, cores=cores)
        fit_i = [i for i, c in enumerate(emu_rows) if c["ranks"] in b.fit_ranks and c["rays_per_rank"] == rays]
        desc = (f"emulated DDP runs at {', '.join(map(str, b.fit_ranks))} ranks and {rays} rays per rank "
                f"({len(fit_i)} configurations); checked on the {len(emu_rows) - len(fit_i)} emulated DDP "
                f"configurations it did not see (other world sizes, other batch sizes); device compute and copies "
                f"are known by construction and given to the model")
        if not fit_i:
            fit_i = list(range(len(emu_rows)))
            desc = "all emulated DDP runs (none at bench.fit_ranks with this batch size: the check is in sample)"
        model = cm.fit([obs[i] for i in fit_i], sampling=sampling["profile"] if sampling else None,
                       grad_bytes=grad_bytes, allreduce_latency_s=b.allreduce_latency_s)
        rows = []
        for i, (c, o) in enumerate(zip(emu_rows, obs)):
            known = c["emulated_step_ms"] * 1e-3  # the device time of a step of the row's rays
            if c["sampler"] != "sync_global":
                known += links.h2d_s(o.rays_per_rank * (RAY_FLOATS * 4 + 24))
            p = model.predict(o.sampler, o.ranks, o.rays_per_rank, o.cores_per_rank, compute_s=known)
            rows.append({"method": o.method, "sampler": o.sampler, "ranks": o.ranks, "rays_per_rank": o.rays_per_rank,
                         "emulated_step_ms": c["emulated_step_ms"], "set": "fit" if i in fit_i else "check",
                         "step_measured_s": o.step_s, "step_predicted_s": p["step"],
                         "stall_measured": o.wait_s / o.step_s if o.step_s > 0 else 0.0, "stall_predicted": p["stall"],
                         "step_error": (p["step"] - o.step_s) / o.step_s if o.step_s > 0 else 0.0})
        return model, rows, desc
    obs = [o for o in observations(derived, cores=cores) if o.method == "ddp"] or observations(derived, cores=cores)
    model = cm.fit(obs, sampling=sampling["profile"] if sampling else None, grad_bytes=grad_bytes,
                   allreduce_latency_s=b.allreduce_latency_s)
    rows = cm.validate(model, obs)
    for o, v in zip(obs, rows):
        v["set"] = "fit"
        v["rays_per_rank"] = o.rays_per_rank
    return model, rows, "the CPU DDP runs (no emulated rows: the check is in sample)"
