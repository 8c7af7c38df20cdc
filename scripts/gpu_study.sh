#!/usr/bin/env bash
# The part of the characterization study that runs on a GPU machine without DALI, in one call:
#   1. the torch-side phases of a training step (h2d, forward, backward, optimizer) of the study's
#      model (configs/study.yaml `model:`) on the GPU at realistic batch sizes;
#   2. the synchronous baselines' sampling cost (torch gather + the one ray formula, the same work
#      sync_local/sync_global do per step) on this machine's CPU cores, 1 thread and all cores,
#      at per-GPU and global batch sizes;
#   3. the same sampler GPU-resident (image cache in device memory, torch gather on the GPU).
# Writes $OUT/gpu_study.json (or ./gpu_study_out/ when OUT is unset) and prints a summary.
# Skipped, and said so in the JSON: the DALI operator path (the DALI wheel is not on the GPU
# machine) and multi-GPU all-reduce (one GPU).
#
#   bash scripts/gpu_study.sh            # on the GPU machine (< 5 minutes)
#   bash scripts/gpu_study.sh --cpu      # same measurements on the CPU, small sizes (tests, laptops)
#
# Feed the result to the projection: dali-nerf bench study bench.gpu_step_ms=<phases[B].step_ms>
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
BUDGET=${GPU_STUDY_SECONDS:-200}
for a in "$@"; do
  case "$a" in
    --cpu) MODE=cpu ;;
    --budget=*) BUDGET="${a#--budget=}" ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "error: unknown argument $a (use --cpu, --budget=SECONDS)" >&2; exit 2 ;;
  esac
done
OUT_DIR="${OUT:-gpu_study_out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
exec "$PY" - "$MODE" "$OUT_DIR" "$BUDGET" <<'EOF'
import json, os, platform, sys, time
from pathlib import Path

mode, out_dir, budget = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
t_begin = time.perf_counter()
import numpy as np
import torch

res = {"mode": mode, "torch": torch.__version__, "cpu_cores": os.cpu_count(), "machine": platform.machine(),
       "skipped": [], "notes": []}
if mode == "gpu" and not torch.cuda.is_available():
    print("error: no GPU visible to torch; run with --cpu for the CPU variant", file=sys.stderr)
    sys.exit(2)
dev = torch.device("cuda" if mode == "gpu" else "cpu")
res["device"] = torch.cuda.get_device_name(0) if mode == "gpu" else "cpu"
sync = (lambda: torch.cuda.synchronize()) if mode == "gpu" else (lambda: None)
GPU = mode == "gpu"

def left():
    return budget - (time.perf_counter() - t_begin)

def timed(fn, min_iters=3, max_iters=30, seconds=4.0, warm=2):
    for _ in range(warm):
        fn()
    sync()
    ts, t_end = [], time.perf_counter() + seconds
    while len(ts) < max_iters and (len(ts) < min_iters or time.perf_counter() < t_end):
        t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), len(ts)

# ---- the study's model ----------------------------------------------------------------------
from dali_nerf.config import ModelConfig, load_config
cfg_file = Path("configs/study.yaml")
# --cpu: a small model so the run stays short (the numbers are then for that model, see "model")
small = [] if GPU else ["model.resolution=32", "model.samples_per_ray=16"]
cfg = load_config(str(cfg_file) if cfg_file.is_file() else None, small, check_paths=False)
mcfg = cfg.model
from dali_nerf.config import config_to_dict
res["model"] = config_to_dict(mcfg)
res["config"] = str(cfg_file) if cfg_file.is_file() else "<defaults>"

# ---- 1. torch-side phases --------------------------------------------------------------------
try:
    from dali_nerf.models import build_field, build_occupancy, render_rays, make_optimizer
except Exception as e:  # model package missing or broken: say so, keep the sampler numbers
    res["skipped"].append(f"model phases: dali_nerf.models not importable ({type(e).__name__}: {e})")
    build_field = None
phase_rows = []
if build_field is not None:
    aabb = torch.tensor([[-1.5] * 3, [1.5] * 3])
    torch.manual_seed(0)
    field = build_field(mcfg, aabb).to(dev)
    occ = build_occupancy(mcfg, aabb)
    occ = occ.to(dev) if occ is not None else None
    opt, sched = make_optimizer(field, cfg, total_steps=10 ** 6)
    res["grad_bytes"] = int(sum(p.numel() * p.element_size() for p in field.parameters() if p.requires_grad))
    bg = torch.ones(3, device=dev)
    sizes = [4096, 16384, 65536] if GPU else [256, 1024]
    for B in sizes:
        if left() < budget * 0.45:
            res["skipped"].append(f"model phases at {B} rays: time budget"); continue
        g = torch.Generator().manual_seed(B)
        eye = torch.randn(B, 3, generator=g); eye = 3.0 * eye / eye.norm(dim=1, keepdim=True)
        tgt = 0.5 * torch.randn(B, 3, generator=g)
        d = tgt - eye; d = d / d.norm(dim=1, keepdim=True)
        cpu_batch = {"origins": eye, "directions": d, "rgb": torch.rand(B, 3, generator=g),
                     "near": torch.full((B, 1), 1.0), "far": torch.full((B, 1), 6.0)}
        if GPU:
            cpu_batch = {k: v.pin_memory() for k, v in cpu_batch.items()}
        acc = {"h2d": [], "forward": [], "backward": [], "optimizer": []}
        def step():
            t0 = time.perf_counter()
            b = {k: v.to(dev, non_blocking=True) for k, v in cpu_batch.items()}; sync(); t1 = time.perf_counter()
            out = render_rays(field, b["origins"], b["directions"], b["near"], b["far"], bg, occupancy=occ,
                              samples=mcfg.samples_per_ray, train=True)
            loss = torch.mean((out["rgb"] - b["rgb"]) ** 2); sync(); t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True); loss.backward(); sync(); t3 = time.perf_counter()
            opt.step(); sync(); t4 = time.perf_counter()
            for k, v in zip(acc, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                acc[k].append(v)
        step_s, n = timed(step, seconds=8.0 if GPU else 2.0, max_iters=40, warm=2 if GPU else 1)
        row = {"rays": B, "iters": n, "step_ms": 1e3 * step_s}
        row.update({f"{k}_ms": 1e3 * float(np.median(v[-n:])) for k, v in acc.items()})
        row["Mrays_per_s"] = B / step_s / 1e6
        phase_rows.append(row)
        print(f"phases  B={B:6d}: " + " ".join(f"{k}={row[k + '_ms']:.2f}ms" for k in acc) + f" step={row['step_ms']:.2f}ms", flush=True)
res["phases"] = phase_rows

# ---- 2./3. sampling: CPU cores vs GPU-resident gather ----------------------------------------
from dali_nerf.rays import rays_from_indices
N, H, W = (100, 800, 800) if GPU else (20, 100, 100)
res["sampler_cache"] = {"images": N, "height": H, "width": W, "bytes": N * H * W * 3}
gen = torch.Generator().manual_seed(1)
pixels = torch.randint(0, 256, (N * H * W, 3), dtype=torch.uint8, generator=gen)
offsets = torch.arange(N, dtype=torch.int64) * (H * W)
widths = torch.full((N,), W, dtype=torch.int64)
ang = torch.linspace(0, 2 * np.pi, N + 1)[:N]
c2w = torch.zeros(N, 3, 4); c2w[:, 0, 0] = 1; c2w[:, 1, 1] = 1; c2w[:, 2, 2] = 1
c2w[:, 0, 3] = 3 * torch.cos(ang); c2w[:, 2, 3] = 3 * torch.sin(ang)
K = torch.tensor([[0.9 * W, 0.9 * W, W / 2, H / 2]]).repeat(N, 1)

def make_sampler(device):
    px, off, wd, cw, kk = (t.to(device) for t in (pixels, offsets, widths, c2w, K))
    P = px.shape[0]
    g = torch.Generator(device=device).manual_seed(2)
    def sample(B):
        pid = torch.randint(0, P, (B,), generator=g, device=device)
        cam = torch.searchsorted(off, pid, right=True) - 1
        local = pid - off[cam]
        w = wd[cam]
        idx = torch.stack([cam, local // w, local % w], 1)
        o, d = rays_from_indices(cw, kk, idx)
        rgb = px[pid].to(torch.float32) / 255.0
        return o, d, rgb, idx
    return sample

samp_rows = []
cpu_sizes = [4096, 32768, 262144] if GPU else [1024, 8192]
cpu_sample = make_sampler(torch.device("cpu"))
for threads in sorted({1, os.cpu_count() or 1}):
    torch.set_num_threads(threads)
    for B in cpu_sizes:
        if left() < budget * 0.2:
            res["skipped"].append(f"cpu sampler {threads} threads {B} rays: time budget"); continue
        s, n = timed(lambda: cpu_sample(B), seconds=2.0, max_iters=20)
        samp_rows.append({"where": "cpu", "threads": threads, "rays": B, "ms": 1e3 * s, "Mrays_per_s": B / s / 1e6, "iters": n})
        print(f"sampler cpu x{threads:2d} B={B:7d}: {1e3 * s:8.2f} ms  {B / s / 1e6:7.2f} Mrays/s", flush=True)
torch.set_num_threads(os.cpu_count() or 1)
if GPU:
    gpu_sample = make_sampler(dev)
    for B in [4096, 32768, 262144, 1048576]:
        if left() < 10:
            res["skipped"].append(f"gpu sampler {B} rays: time budget"); continue
        s, n = timed(lambda: gpu_sample(B), seconds=2.0, max_iters=50)
        samp_rows.append({"where": "gpu", "threads": 0, "rays": B, "ms": 1e3 * s, "Mrays_per_s": B / s / 1e6, "iters": n})
        print(f"sampler gpu      B={B:7d}: {1e3 * s:8.2f} ms  {B / s / 1e6:7.2f} Mrays/s", flush=True)
else:
    res["skipped"].append("gpu-resident sampler: --cpu mode")
res["samplers"] = samp_rows
res["skipped"].append("DALI operator path (fn.dali_nerf.ray_sampler, RayLoader): the DALI wheel is not on this machine")
res["skipped"].append("gradient all-reduce: one GPU, no NCCL peers")
res["notes"].append("sampler = the synchronous baselines' per-step work: random pixel ids, image lookup "
                    "(searchsorted), gather uint8 rgb, rays_from_indices; cache is random uint8 of the stated size")
res["wall_s"] = time.perf_counter() - t_begin
(out_dir / "gpu_study.json").write_text(json.dumps(res, indent=2))
print(f"wrote {out_dir / 'gpu_study.json'} in {res['wall_s']:.1f} s; skipped: " + "; ".join(res["skipped"]), flush=True)
EOF
