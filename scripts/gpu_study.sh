#!/usr/bin/env bash
# The GPU machine's run, in one call (about 10 minutes on one H200; correctness first):
#   0. DALI: used if importable, else installed (--no-deps, into a temporary folder) from a wheel
#      under .whl/ (one *.whl, or its pieces *.whl.part* joined in name order); without one every
#      DALI step below is SKIPPED and said so;
#   1. build the CUDA plugin with nvcc (dali-nerf build-op --cuda)              [DALI, nvcc]
#   2. pytest -m gpu: the GPU tests (CUDA op vs the numpy reference and the CPU op, routing,
#      CUDA batches without copies, nvJPEG, 1-rank CUDA DDP and SS)            [DALI, nvcc]
#   3. the op's Mrays/s with the images resident in device memory
#      (benchmarks/op_throughput.py --gpu)                                      [DALI]
#   4. the torch study (below): phases of a training step on the GPU, the synchronous samplers on
#      the CPU cores, and the same sampler as a torch gather on the GPU (the op's comparison)
#   5. the GPU quality config (configs/ddp_blender_gpu.yaml, 1 rank, the time left)  [DALI]
# Everything goes under $OUT (or ./gpu_study_out/): one log per step, steps.txt (RAN / SKIPPED /
# FAILED per step, with the reason), gpu_study.json (step 4).
#
#   bash scripts/gpu_study.sh            # on the GPU machine
#   bash scripts/gpu_study.sh --dry-run  # here, no GPU: every step that can run without one (the
#                                        # nvcc build, the gpu tests' collection and skips, the
#                                        # benchmark and the study on the CPU, the config) and
#                                        # the skips; exit 1 if a step that should run fails
#   bash scripts/gpu_study.sh --cpu      # only step 4 on the CPU, small sizes (laptops)
#
# Budgets: GPU_STUDY_TOTAL (s, default 540) for the whole run; the torch study gets
# GPU_STUDY_SECONDS (default 150) or --budget=SECONDS. QUALITY_STEPS (default 3000) caps step 5;
# without data/lego it trains on a generated scene of QUALITY_IMAGES (100) at QUALITY_RES (800).
# A rerun of part of it: GPU_STUDY_SKIP=op-throughput,study,quality (step names, comma-separated)
# and GPU_TESTS_K=<pytest -k expression> for step 2.
# DALI travels in pieces (the GPU machine has none, and one call carries at most 64 MiB): here,
# bash scripts/gpu_pack_dali.sh writes .whl/dali_site.tar.xz.part0..2 (DALI for CUDA 13 and its
# dependencies, unpacked); carry one piece a call, the run unpacks them (step 0).
# Feed the result to the projection: dali-nerf bench study bench.gpu_step_ms=<phases[B].step_ms>
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
BUDGET=${GPU_STUDY_SECONDS:-150}
TOTAL=${GPU_STUDY_TOTAL:-540}
for a in "$@"; do
  case "$a" in
    --cpu) MODE=cpu ;;
    --dry-run) MODE=dry ;;
    --budget=*) BUDGET="${a#--budget=}" ;;
    -h|--help) sed -n 2,27p "$0"; exit 0 ;;
    *) echo "error: unknown argument $a (use --dry-run, --cpu, --budget=SECONDS)" >&2; exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9.]*) echo "error: --budget=$BUDGET: give seconds, e.g. --budget=120" >&2; exit 2 ;; esac
OUT_DIR="${OUT:-gpu_study_out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS="$OUT_DIR/steps.txt"
: > "$STEPS"
T0=$SECONDS
FAILED=0
note() { echo "$1 $2: $3" | tee -a "$STEPS"; }
left() { echo $(( TOTAL - (SECONDS - T0) )); }
# run_step NAME LIMIT_S CMD...: log to $OUT_DIR/NAME.log, one line in steps.txt
run_step() {
  local name=$1 limit=$2; shift 2
  local log="$OUT_DIR/$name.log"
  if (( limit < 5 )); then note SKIPPED "$name" "time budget spent"; return 1; fi
  echo "== $name (limit ${limit}s): $*" | tee "$log"
  if timeout "$limit" "$@" >>"$log" 2>&1; then
    note RAN "$name" "ok, $(( SECONDS - T0 ))s into the run (log: $log)"
    return 0
  fi
  local rc=$?
  note FAILED "$name" "exit $rc$([ $rc = 124 ] && echo ', timed out') (log: $log)"
  tail -n 15 "$log" | sed 's/^/    /'
  FAILED=1
  return 1
}
skip() { [[ ",${GPU_STUDY_SKIP:-}," == *",$1,"* ]]; }
have_dali() { "$PY" -c "import nvidia.dali" >/dev/null 2>&1; }
have_gpu() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
have_nvcc() { "$PY" -c "import sys; from dali_nerf.ops import _find_nvcc; sys.exit(0 if _find_nvcc() else 1)" >/dev/null 2>&1; }

# step 4, the torch study: this Python program (argv: mode out_dir budget_s)
STUDY_PY="${TMPDIR:-/tmp}/gpu_study_$$.py"
trap 'rm -f "$STUDY_PY"' EXIT
cat > "$STUDY_PY" <<'EOF'
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
res["notes"].append("the DALI operator path (fn.dali_nerf.ray_sampler with device-resident images) is step 3 of "
                    "scripts/gpu_study.sh (op-throughput.log), run when DALI is present (steps.txt says)")
res["skipped"].append("gradient all-reduce: one GPU, no NCCL peers")
res["notes"].append("sampler = the synchronous baselines' per-step work: random pixel ids, image lookup "
                    "(searchsorted), gather uint8 rgb, rays_from_indices; cache is random uint8 of the stated size")
res["wall_s"] = time.perf_counter() - t_begin
(out_dir / "gpu_study.json").write_text(json.dumps(res, indent=2))
print(f"wrote {out_dir / 'gpu_study.json'} in {res['wall_s']:.1f} s; skipped: " + "; ".join(res["skipped"]), flush=True)
EOF

if [ "$MODE" = cpu ]; then
  "$PY" "$STUDY_PY" cpu "$OUT_DIR" "$BUDGET"
  exit $?
fi

if [ "$MODE" = gpu ] && ! have_gpu; then
  echo "error: no GPU visible to torch; run with --dry-run (checks) or --cpu (the CPU study)" >&2
  exit 2
fi
echo "gpu_study: mode $MODE, out $OUT_DIR, total budget ${TOTAL}s" | tee "$OUT_DIR/README.txt"

# ---- 0. DALI ----------------------------------------------------------------------------------
DALI=0
if have_dali; then
  DALI=1; note RAN dali "importable: $("$PY" -c 'import nvidia.dali as d; print(d.__version__)')"
elif ls .whl/*.tar.xz.part* >/dev/null 2>&1 && [ "$MODE" != dry ]; then
  # an unpacked site (DALI and its dependencies, made by scripts/gpu_pack_dali.sh), carried in pieces
  SITE="${TMPDIR:-/tmp}/dali_nerf_dali_site"
  mkdir -p "$SITE"
  if cat $(ls .whl/*.tar.xz.part* | sort) | xz -d -T0 | tar -xf - -C "$SITE"; then
    rm -f "$SITE/nvidia/__init__.py"  # nvimgcodec's: keep nvidia/ a namespace shared with torch's CUDA wheels
    export PYTHONPATH="$PYTHONPATH:$SITE"
  fi
  if have_dali; then DALI=1; note RAN dali "unpacked from .whl/*.tar.xz.part*: $("$PY" -c 'import nvidia.dali as d; print(d.__version__)')"
  else note FAILED dali "unpacked .whl/*.tar.xz.part* into $SITE but nvidia.dali is not importable"; FAILED=1; fi
else
  WHEEL=$(ls .whl/*.whl 2>/dev/null | head -n 1)
  if [ -z "$WHEEL" ]; then
    PART=$(ls .whl/*.whl.part* 2>/dev/null | head -n 1)
    if [ -n "$PART" ]; then
      BASE=${PART%.part*}
      WHEEL="${TMPDIR:-/tmp}/$(basename "$BASE")"
      cat $(ls "$BASE".part* | sort) > "$WHEEL"
    fi
  fi
  if [ -z "$WHEEL" ]; then
    note SKIPPED dali "not importable and no wheel under .whl/: steps 1, 2, 3 and 5 need DALI"
  elif [ "$MODE" = dry ]; then
    note SKIPPED dali "dry run: would install $WHEEL (pip --no-deps --target)"
  else
    SITE="${TMPDIR:-/tmp}/dali_nerf_dali_site"
    if run_step dali-install "$(left)" "$PY" -m pip install -q --no-deps --target "$SITE" "$WHEEL"; then
      export PYTHONPATH="$PYTHONPATH:$SITE"
      if have_dali; then DALI=1; else note FAILED dali "installed from $WHEEL but not importable (missing dependencies?)"; FAILED=1; fi
    fi
  fi
fi
# trainers/ and pipelines/ are installed inside the package (setup.cfg's package_dir): a bare
# checkout on PYTHONPATH lacks dali_nerf.trainers / dali_nerf.pipelines until it is installed
if ! "$PY" -c "import dali_nerf.pipelines, dali_nerf.trainers" >/dev/null 2>&1; then
  run_step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
NVCC=0; have_nvcc && NVCC=1
GPU=0; [ "$MODE" = gpu ] && GPU=1
# the GPU run builds for its own GPU only (sm_90 on an H200: half the nvcc time of the default)
[ $GPU = 1 ] && export DALI_NERF_CUDA_ARCHS="${DALI_NERF_CUDA_ARCHS:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')}"

# ---- 1. build -----------------------------------------------------------------------------------
if [ $DALI = 0 ]; then note SKIPPED build "no DALI (its headers and library are needed)"
elif [ $NVCC = 0 ]; then note SKIPPED build "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
else run_step build "$(( $(left) < 600 ? $(left) : 600 ))" "$PY" -m dali_nerf build-op --cuda
fi

# ---- 2. gpu tests -------------------------------------------------------------------------------
if skip gpu-tests; then note SKIPPED gpu-tests "GPU_STUDY_SKIP"
elif [ $DALI = 0 ]; then note SKIPPED gpu-tests "no DALI"
elif [ $GPU = 1 ]; then run_step gpu-tests "$(( $(left) - 120 ))" "$PY" -m pytest -q -rs -m gpu ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} tests/
else
  # dry: the gpu tests must be collected and skipped, each with its reason
  if run_step gpu-tests-collect 300 "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py; then
    if grep -q "passed\|failed\|error" "$OUT_DIR/gpu-tests-collect.log" || ! grep -q "SKIPPED.*GPU test: " "$OUT_DIR/gpu-tests-collect.log"; then
      note FAILED gpu-tests-collect "expected every gpu test skipped with its reason"; FAILED=1
    fi
  fi
fi

# ---- 3. the op's throughput ---------------------------------------------------------------------
if skip op-throughput; then note SKIPPED op-throughput "GPU_STUDY_SKIP"
elif [ $DALI = 0 ]; then note SKIPPED op-throughput "no DALI"
elif [ $GPU = 1 ]; then
  run_step op-throughput "$(( $(left) < 150 ? $(left) : 150 ))" "$PY" benchmarks/op_throughput.py --gpu \
    --images 100 --res 800 --rays 262144,1048576 --seconds 4 --threads 4
else
  run_step op-throughput-cpu 300 "$PY" benchmarks/op_throughput.py --images 2 --res 32 --rays 1024 \
    --seconds 0.4 --modes random,routed
fi

# ---- 4. the torch study -------------------------------------------------------------------------
if skip study; then note SKIPPED study "GPU_STUDY_SKIP"
elif [ $GPU = 1 ]; then
  B=$(( $(left) - 90 )); (( B > ${BUDGET%.*} )) && B=${BUDGET%.*}
  run_step study "$(( B + 60 ))" "$PY" "$STUDY_PY" gpu "$OUT_DIR" "$B"
else
  run_step study-cpu 300 "$PY" "$STUDY_PY" cpu "$OUT_DIR" 20
fi

# ---- 5. the GPU quality config ------------------------------------------------------------------
CFG=configs/ddp_blender_gpu.yaml
if skip quality; then note SKIPPED quality "GPU_STUDY_SKIP"
elif [ $GPU = 1 ] && [ $DALI = 1 ]; then
  SCENE=data/lego
  if [ ! -d "$SCENE" ]; then
    QRES=${QUALITY_RES:-800}; QIMG=${QUALITY_IMAGES:-100}
    SCENE="${TMPDIR:-/tmp}/dali_nerf_objects${QRES}x${QIMG}"
    if [ -f "$SCENE/transforms_train.json" ]; then note RAN make-scene "reused $SCENE (an earlier call made it)"
    else
      run_step make-scene "$(( $(left) / 3 ))" "$PY" -m dali_nerf make-scene objects --out "$SCENE" \
        --resolution "$QRES" --images "$QIMG" --force || SCENE=
    fi
  fi
  if [ -n "$SCENE" ]; then
    run_step quality "$(( $(left) - 10 ))" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
      -m dali_nerf.trainers.ddp --config "$CFG" "scene.path=$SCENE" "train.runs_dir=$OUT_DIR/runs" \
      "train.steps=${QUALITY_STEPS:-3000}" train.checkpoint_every=0
  fi
else
  note SKIPPED quality "$([ $GPU = 0 ] && echo 'no GPU (dry run)' || echo 'no DALI')"
  run_step quality-config 60 "$PY" -c "from dali_nerf.config import load_config; \
c = load_config('$CFG', ['scene.path=data/lego'], check_paths=False); \
assert c.train.device == 'cuda', c.train.device; print('config ok:', c.name)"
fi

echo "---- steps ($(( SECONDS - T0 ))s) ----"
cat "$STEPS"
exit $FAILED
