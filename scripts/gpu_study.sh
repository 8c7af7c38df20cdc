#!/usr/bin/env bash
# The GPU machine's run, in one device call of at most 9 minutes (GPU_STUDY_TOTAL, default 540 s).
# Steps in the order of their value, each with a time slice (its limit; a step that ends early
# leaves its time to the ones after it; the gpu tests get what is left):
#
#   step        slice  what                                                            writes
#   dali          20   DALI importable, else the pieces under .whl/ checked (sha256)   dali.log
#                      and unpacked into .whl/site (scripts/gpu_pack_dali.sh)
#   install       20   pip install --no-deps -e . (dali_nerf.trainers / .pipelines)   install.log
#   build         80   the CUDA plugin with nvcc, for this GPU's arch only (a plugin    build.log
#                      already in the cache is reused, and its line says "reused")
#   make-scene    35   a generated objects scene, 100 images of 800x800                make-scene.log
#   loop          90   dali-nerf bench loop: configs/ddp_blender_gpu.yaml's model on   loop/loop.json, loop.md
#                      the GPU, CUDA-event phases, 3 rotated trials at 16384 and
#                      65536 rays: rays, rays_sync (the same sampler,
#                      synchronous), sync_local, sync_global, torch_workers and a
#                      ready-batch floor; images in host memory and in GPU memory;
#                      step, wait, stall, step / floor, peak GPU memory, device step
#   study-host   100   dali-nerf bench study on the same scene and grid as the CPU      study/<host>/report.md,
#                      machine's (configs/study.yaml: 4096-65536 rays per GPU, the     derived.json, *.png
#                      H200-measured device step), emulated devices on this host's
#                      cores: DDP at 2 and 8 GPUs (the headline's 2-8 GPUs), 2 trials
#   ttq          185   time to quality: configs/ddp_blender_gpu.yaml on the 800x800    ttq/summary.json,
#                      scene, eval every 15 s, until 34 dB or 150 s of training        metrics.jsonl, renders/
#   splat         60   trainers/splat.py on the objects scene as a COLMAP folder, on    splat/summary.json,
#                      the GPU (gsplat's rasterization when gsplat is installed, else    metrics.jsonl
#                      our torch one: summary.json "rasteriser" says which), 3000 steps
#   decode        20   images/s at 800x800: the CPU decoder on all cores, nvJPEG       decode/decode.json
#   gpu-tests   rest   pytest -m gpu (the CUDA op also on the streaming path)         gpu-tests.log
#
# Every step: one line in steps.txt, RAN / SKIPPED / FAILED with the reason (exit code or "timed
# out"), and its log <step>.log; the measurements rewrite their files as they go, so a step cut
# short keeps what it measured. README.txt: the machine, commit and settings. In a device call
# ($OUT set; it brings back at most 8 files) everything is packed into $OUT/gpu_study.tar.gz after
# every step, beside $OUT/steps.txt and $OUT/README.txt.
#
#   bash scripts/gpu_study.sh              # on the GPU machine (docs/gpu/README.md: the device calls)
#   bash scripts/gpu_study.sh --dry-run    # here, no GPU: every step on the CPU at toy sizes (the
#                                          # GPU-only parts SKIPPED with the reason); exit 1 if one fails
#   bash scripts/gpu_study.sh --pieces     # which DALI pieces have arrived under .whl/, intact or not
#                                          # (exit 1: no checksum file, or a corrupt or stray piece)
#
# Reruns: GPU_STUDY_ONLY=gpu-tests,decode (only these steps, plus what they need) or
# GPU_STUDY_SKIP=loop,... ; GPU_TESTS_K=<pytest -k expression> for gpu-tests. Outputs go to $OUT
# (the device call's folder) or ./gpu_study_out/; the scene and run folders to $GPU_STUDY_WORK
# (default .whl/gpu_study_work on the GPU machine, $TMPDIR/dali_nerf_gpu_study in a dry run: a
# warm machine's second call reuses the scene and the results of the first).
# GPU_STUDY_PLUGIN_CACHE (a dry run only; the GPU run ignores it): the plugin cache of the build
# step (its DALI_NERF_CACHE; the other steps keep theirs). The tests build the CUDA plugin there
# once (tests/conftest.py) and the dry run's build step reuses it.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_lib.sh
MODE=gpu
for a in "$@"; do
  case "$a" in
    --dry-run) MODE=dry ;;
    --pieces) MODE=pieces ;;
    -h|--help) sed -n '2,/^set /{/^set /!p}' "$0"; exit 0 ;;
    *) echo "error: unknown argument $a (use --dry-run or --pieces; no argument on the GPU machine)" >&2; exit 2 ;;
  esac
done
TOTAL=${GPU_STUDY_TOTAL:-$([ "$MODE" = dry ] && echo 1800 || echo 540)}
case "$TOTAL" in ''|*[!0-9]*) echo "error: GPU_STUDY_TOTAL=$TOTAL: give whole seconds, e.g. 540" >&2; exit 2 ;; esac
if [ "$MODE" = pieces ]; then  # exit 1 only for what carrying again must fix: no checksums, a corrupt or stray piece
  report=$(verify_pieces .whl); echo "$report"
  ! grep -q "^corrupt \|^stray \|^no " <<< "$report"; exit $?
fi
# large run folders (the scene, checkpoints, per-segment metrics): not under $OUT; on the GPU
# machine in the checkout's ignored .whl/ (kept between the calls of a warm machine, like the
# unpacked DALI and the plugin cache: a rerun right after the run finds them)
WORK="${GPU_STUDY_WORK:-$([ "$MODE" = gpu ] && echo "$PWD/.whl/gpu_study_work" || echo "${TMPDIR:-/tmp}/dali_nerf_gpu_study")}"
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
# the results: in $OUT_DIR; with $OUT set (a device call, which brings back at most 8 files) they
# are written under $WORK/results and packed into $OUT/gpu_study.tar.gz after every step, beside
# copies of steps.txt and README.txt
if [ -n "${OUT:-}" ]; then OUT_DIR="$WORK/results"; mkdir -p "$OUT"; else OUT_DIR="gpu_study_out"; fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OPENCV_LOG_LEVEL=ERROR
PY=${PYTHON:-python3}
STEPS="$OUT_DIR/steps.txt"
: > "$STEPS"
T0=$SECONDS
FAILED=0
pack() {  # the results so far into $OUT (a call stopped at its limit still brings back the last pack)
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/.gpu_study.tar.gz" -C "$OUT_DIR" . && mv -f "$OUT/.gpu_study.tar.gz" "$OUT/gpu_study.tar.gz"
  cp -f "$STEPS" "$OUT_DIR/README.txt" "$OUT/" 2>/dev/null
  return 0
}

want() {  # want STEP: not excluded by GPU_STUDY_SKIP / GPU_STUDY_ONLY
  [[ ",${GPU_STUDY_SKIP:-}," == *",$1,"* ]] && return 1
  [ -z "${GPU_STUDY_ONLY:-}" ] || [[ ",${GPU_STUDY_ONLY}," == *",$1,"* ]]
}
skipped_by_env() { note SKIPPED "$1" "GPU_STUDY_SKIP / GPU_STUDY_ONLY"; }
# slice SECONDS: the step's limit (its slice, or what is left); a dry run's steps get what is left of
# GPU_STUDY_TOTAL (it checks that every step works, not how long it takes: toy sizes on a CPU, whose
# first nvcc build alone took over 300 s on a busy 2-core host)
slice() { local l s=$1; l=$(left); [ "$MODE" = dry ] && s=$l; echo $(( s < l ? s : l )); }
have_dali() { "$PY" -c "import nvidia.dali" >/dev/null 2>&1; }
have_gpu() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
have_nvcc() { "$PY" -c "import sys; from dali_nerf.ops import _find_nvcc; sys.exit(0 if _find_nvcc() else 1)" >/dev/null 2>&1; }

if [ "$MODE" = gpu ] && ! have_gpu; then
  echo "error: no GPU visible to torch; run with --dry-run (every step on the CPU at toy sizes)" >&2
  exit 2
fi
GPU=0; [ "$MODE" = gpu ] && GPU=1

# sizes: the device run's, or toy sizes on the CPU (--dry-run)
if [ $GPU = 1 ]; then
  RES=${QUALITY_RES:-800}; IMAGES=${QUALITY_IMAGES:-100}
  LOOP_BATCHES=${LOOP_BATCHES:-16384,65536}
  LOOP_ARGS=(--batches "$LOOP_BATCHES" --trials 3 --steps 12 --warmup 4 --pretrain 60 --device cuda)
  MODEL=()
  # the CPU machine's grid (configs/study.yaml: its rays per GPU, the measured device step) on every
  # usable core at 2 and 8 GPUs (16 cores: 8 and 2 cores per GPU, the headline's 2-8 GPUs); what fits
  # the slice: DDP, one device step, 2 trials, no cache row, no sampler table
  STUDY_ARGS=("bench.emulated_ranks=[2,8]" "bench.emulated_cores=[0]" "bench.trials=${STUDY_TRIALS:-2}"
              bench.emulated_steps=20 bench.emulated_warmup=3 "bench.only_steps=[measured]")
  TTQ_SECONDS=${QUALITY_SECONDS:-150}; TTQ_ARGS=(train.eval_every_s=15 train.target_psnr=${QUALITY_TARGET:-34}
                                                 train.eval_images=4)
  DECODE_ARGS=(--images 100 --size 800 --threads 0 --reps 3)
  export DALI_NERF_CACHE="${DALI_NERF_CACHE:-$PWD/.whl/plugin_cache}"  # kept while the machine stays warm
  # the GPU run builds for its own GPU only (sm_90 on an H100/H200: half the nvcc time of the default)
  export DALI_NERF_CUDA_ARCHS="${DALI_NERF_CUDA_ARCHS:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')}"
else
  RES=32; IMAGES=8
  LOOP_ARGS=(--batches 256 --trials 1 --steps 2 --warmup 1 --pretrain 2 --device cpu)
  MODEL=(model.resolution=12 model.samples_per_ray=8 model.occupancy_resolution=8 model.hidden=8
         model.density_components=2 model.color_components=4 model.view_dependent=false
         pipeline.rays_per_run=1024 pipeline.workers=1 pipeline.num_threads=1)
  # the same grid's rays and device step on the toy scene, 2 ranks, sync_local only (the DALI sources'
  # warm-up of whole runs is many steps; the study's own tests run every sampler)
  STUDY_ARGS=("bench.emulated_ranks=[2]" "bench.emulated_cores=[0]" bench.trials=1 bench.emulated_steps=3
              bench.emulated_warmup=1 "bench.only_steps=[measured]" "bench.emulated_samplers=[sync_local]")
  TTQ_SECONDS=2; TTQ_ARGS=(train.eval_every_s=0.5 train.target_psnr=99 train.eval_images=1 train.device=cpu
                            pipeline.rays_per_batch=256)
  DECODE_ARGS=(--images 4 --size 64 --threads 1 --reps 1)
fi
SCENE="${SCENE:-$WORK/objects_${RES}x${IMAGES}}"
{
  echo "gpu_study: mode $MODE, total budget ${TOTAL}s, out $OUT_DIR, started $(date -u +%FT%TZ)"
  if git rev-parse HEAD >/dev/null 2>&1; then
    echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':(exclude)docs' || echo ' (+ uncommitted changes)')"
  fi
  echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //')"
  [ $GPU = 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null
} | tee "$OUT_DIR/README.txt"

# ---- dali: importable, or the pieces checked and unpacked ------------------------------------------
SITE="$PWD/.whl/site"
if have_dali; then
  note RAN dali "importable: $("$PY" -c 'import nvidia.dali as d; print(d.__version__, "cuda", d.__cuda_version__)')"
elif [ "$MODE" = dry ]; then
  note SKIPPED dali "dry run: DALI is not importable here"
elif run_step dali "$(slice 20)" unpack_pieces .whl "$SITE"; then
  export PYTHONPATH="$PYTHONPATH:$SITE"
  if ! have_dali; then note FAILED dali "unpacked into $SITE but nvidia.dali is not importable"; FAILED=1; fi
fi
DALI=0; have_dali && DALI=1
if [ "$MODE" = dry ]; then  # the pieces' checks run here when there are pieces (the tests make their own)
  if [ -f .whl/dali_site.sha256 ]; then run_step dali-pieces 60 verify_pieces .whl
  else note SKIPPED dali-pieces "no .whl/dali_site.sha256 here (bash scripts/gpu_pack_dali.sh makes the pieces)"; fi
fi

pack

# ---- install: trainers/ and pipelines/ are packaged inside dali_nerf (setup.cfg's package_dir) ------
if "$PY" -c "import dali_nerf.pipelines, dali_nerf.trainers" >/dev/null 2>&1; then
  note SKIPPED install "dali_nerf.trainers and dali_nerf.pipelines already importable"
else
  run_step install "$(slice 20)" "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi

pack

# ---- build: the CUDA plugin ----------------------------------------------------------------------
NVCC=0; have_nvcc && NVCC=1
BUILD=("$PY" -m dali_nerf build-op --cuda)
if [ "$MODE" = dry ] && [ -n "${GPU_STUDY_PLUGIN_CACHE:-}" ]; then
  BUILD=(env "DALI_NERF_CACHE=$GPU_STUDY_PLUGIN_CACHE" "${BUILD[@]}")
fi
if [ $DALI = 0 ]; then note SKIPPED build "no DALI (its headers and library are needed)"
elif [ $NVCC = 0 ]; then note SKIPPED build "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
else run_build build "$(slice 80)" "${BUILD[@]}"
fi

pack

# ---- make-scene ----------------------------------------------------------------------------------
if [ -f "$SCENE/transforms_train.json" ]; then note RAN make-scene "reused $SCENE (made by an earlier call)"
elif [ $DALI = 0 ]; then note SKIPPED make-scene "no DALI: nothing below could use it"
else run_step make-scene "$(slice 35)" "$PY" -m dali_nerf make-scene objects --out "$SCENE" --resolution "$RES" \
       --images "$IMAGES" --force || SCENE=
fi
HAVE_SCENE=0; [ -n "$SCENE" ] && [ -f "$SCENE/transforms_train.json" ] && HAVE_SCENE=1
CFG=configs/ddp_blender_gpu.yaml

pack

# ---- loop: the training loop per sampler on this device --------------------------------------------
if ! want loop; then skipped_by_env loop
elif [ $DALI = 0 ] || [ $HAVE_SCENE = 0 ]; then note SKIPPED loop "no DALI or no scene (see above)"
else
  run_step loop "$(slice 90)" "$PY" -m dali_nerf bench loop --config "$CFG" --scene "$SCENE" "${LOOP_ARGS[@]}" \
    --out "$OUT_DIR/loop" ${MODEL[@]+"${MODEL[@]}"}
fi

pack

# ---- study-host: the emulated study on this host's cores, the CPU machine's scene and grid -------------
if ! want study-host; then skipped_by_env study-host
elif [ $DALI = 0 ] || [ $HAVE_SCENE = 0 ]; then note SKIPPED study-host "no DALI or no scene (see above)"
else
  run_step study-host "$(slice 100)" "$PY" -m dali_nerf bench study --config configs/study.yaml "scene.path=$SCENE" \
    "bench.ranks=[]" "bench.methods=[ddp]" "bench.small_scene=" "bench.sampling_sizes=[]" bench.sampler_seconds=0 \
    "bench.out=$OUT_DIR/study" "train.runs_dir=$WORK/study_runs" "${STUDY_ARGS[@]}"
fi

pack

# ---- ttq: time to quality at the config's own size -------------------------------------------------
if ! want ttq; then skipped_by_env ttq
elif [ $DALI = 0 ] || [ $HAVE_SCENE = 0 ]; then note SKIPPED ttq "no DALI or no scene (see above)"
else
  rm -rf "$WORK/runs/ttq"
  run_step ttq "$(slice 185)" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m dali_nerf.trainers.ddp --config "$CFG" "scene.path=$SCENE" "train.runs_dir=$WORK/runs" name=ttq \
    train.checkpoint_every=0 train.log_every=100 "train.max_seconds=$TTQ_SECONDS" "${TTQ_ARGS[@]}" ${MODEL[@]+"${MODEL[@]}"}
  mkdir -p "$OUT_DIR/ttq"  # the run's files but its checkpoint (hundreds of MB)
  for f in summary.json metrics.jsonl config.yaml renders; do
    [ -e "$WORK/runs/ttq/$f" ] && cp -r "$WORK/runs/ttq/$f" "$OUT_DIR/ttq/"
  done
fi

pack

# ---- splat: the Gaussian-splatting trainer on this device (gsplat's rasterization where installed) ---
if ! want splat; then skipped_by_env splat
elif [ $DALI = 0 ]; then note SKIPPED splat "no DALI"
else
  SPLAT_SCENE="$WORK/splat_${RES}x${IMAGES}"
  if [ $GPU = 1 ]; then SPLAT_ARGS=(train.device=cuda train.steps=${SPLAT_STEPS:-3000} train.eval_images=0)
  else SPLAT_ARGS=(train.device=cpu train.steps=4 train.eval_images=1 splat.refine_start=2 splat.refine_every=2); fi
  rm -rf "$WORK/runs/splat"
  if [ -d "$SPLAT_SCENE/sparse/0" ] || "$PY" -m dali_nerf make-scene objects --format colmap --out "$SPLAT_SCENE" \
       --resolution "$RES" --images "$IMAGES" --force >/dev/null; then
    # one rank: the trainer alone (world size 1; torchrun would add its own start-up and nothing else)
    run_step splat "$(slice 60)" "$PY" -m dali_nerf.trainers.splat --config configs/splat_objects.yaml "scene.path=$SPLAT_SCENE" \
      "train.runs_dir=$WORK/runs" name=splat train.checkpoint_every=0 train.tensorboard=never "${SPLAT_ARGS[@]}"
    mkdir -p "$OUT_DIR/splat"
    for f in summary.json metrics.jsonl; do [ -e "$WORK/runs/splat/$f" ] && cp "$WORK/runs/splat/$f" "$OUT_DIR/splat/"; done
  else note FAILED splat "make-scene --format colmap failed"; FAILED=1
  fi
fi

pack

# ---- decode: images/s of the CPU decoder and nvJPEG ------------------------------------------------
if ! want decode; then skipped_by_env decode
elif [ $DALI = 0 ]; then note SKIPPED decode "no DALI"
else run_step decode "$(slice 20)" "$PY" -m dali_nerf bench decode "${DECODE_ARGS[@]}" --out "$OUT_DIR/decode"
fi

pack

# ---- gpu-tests: what is left of the budget ---------------------------------------------------------
if ! want gpu-tests; then skipped_by_env gpu-tests
elif [ $DALI = 0 ]; then note SKIPPED gpu-tests "no DALI"
elif [ $GPU = 1 ]; then
  K=(); [ -n "${GPU_TESTS_K:-}" ] && K=(-k "$GPU_TESTS_K")
  run_step gpu-tests "$(left)" "$PY" -m pytest -q -rs -v -p no:randomly -m gpu ${K[@]+"${K[@]}"} tests/test_gpu.py
else  # dry: collected, and every one skipped with its reason
  if run_step gpu-tests 120 "$PY" -m pytest -q -rs -p no:randomly -m gpu tests/test_gpu.py; then
    if grep -q "passed\|failed\|error" "$OUT_DIR/gpu-tests.log" || ! grep -q "SKIPPED.*GPU test: " "$OUT_DIR/gpu-tests.log"; then
      sed -i '$ d' "$STEPS"
      note FAILED gpu-tests "expected every gpu test collected and skipped with its reason (log: $OUT_DIR/gpu-tests.log)"
      FAILED=1
    fi
  fi
fi

pack
echo "---- steps ($(( SECONDS - T0 ))s of ${TOTAL}s) ----"
cat "$STEPS"
exit $FAILED
