"""``dali-nerf bench sampler``: delivered rays/s of every batch source, and decode images/s.

One run measures, at each batch size (``--batches``, default 4096 and 65536 rays per step):

* ``rays``: RayLoader (our DALI pipeline + C++ operator, prefetch 2, 262144 rays per run) on
  ``--stream`` (default ``global``, the trainers' default ``pipeline.stream``: one rank, so every
  position of the split's global stream is kept; ``shard``: the rank's own stream, what this
  benchmark measured before the global stream existed);
* SS (scenes with near/far): SpatialRayLoader routed to cell 0 of a 2x2 grid, as a share of
  ``rays`` (the spatial-segmentation loader's cost of routing);
* ``sync_local``: SyncLocalSampler (sampling in the training thread);
* ``sync_global``: SyncGlobalSampler with 2 real gloo ranks on 127.0.0.1; rank 0's delivered
  rays/s of the *global* batch (2 B rays per step: sample + scatter);
* ``torch_workers``: TorchWorkersSampler with 2 worker processes;
* ``torch_gather``: a plain in-memory torch loop (iid pixel ids over all images, uint8 gather +
  ``rays_from_indices``), the simplest fast thing one would write;

each with the ratio of ours to it. The consumer loop only touches the batch, so the numbers are
the sampler's. Every source is measured once per round, ``--rounds`` (default 3) interleaved
rounds of ``--seconds``, and keeps its best round, so that a machine whose speed drifts favours
no source. Also decode images/s of DALI's decoder (JPEG and PNG RGBA, 800x800, 2 threads)
through :func:`~dali_nerf.data.imagecache.decode_cache`.

Default scene (no ``--scene``): a 100-image 400x400 ``objects`` scene generated once into
``~/.cache/dali_nerf/bench/objects_400x400_100``. ``--mask F`` measures masks instead: RayLoader
on the scene with a fraction F of every image masked against it unmasked, interleaved
(:mod:`dali_nerf.bench.masked`).

    dali-nerf bench sampler --seconds 2 --rounds 3 --out docs/sampler.md
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import warnings
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock

from dali_nerf.config import PartitionConfig
from dali_nerf.errors import ConfigError
from dali_nerf.data.imagecache import decode_cache
from dali_nerf.partition import Partition
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.data.rays import rays_from_indices
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene
from dali_nerf.scenes.base import Scene
from dali_nerf.sources import make_source

__all__ = ["main", "measure", "measure_table", "table_markdown", "default_scene", "decode_rate", "synthetic_images",
           "torch_gather_source", "SOURCES"]


def default_scene_dir() -> Path:
    base = os.environ.get("DALI_NERF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dali_nerf")
    return Path(base) / "bench" / "objects_400x400_100"


def default_scene():
    """The 100-image 400x400 objects scene (generated once, under a file lock)."""
    out = default_scene_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "transforms_train.json").is_file():
            print(f"generating the benchmark scene in {out} (once) ...", flush=True)
            make_scene("objects", out, width=400, height=400, n_train=100, n_val=1, n_test=1, seed=0, force=True)
    return load_scene(out, split="train")


def torch_gather_source(cache, scene, B: int, seed: int = 0):
    """Infinite generator of batches: iid pixel ids over all of ``cache``, uint8 gather, rays_from_indices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pixels = torch.from_numpy(cache.pixels)
    lay = torch.from_numpy(np.array(cache.layout))
    off, wid, cams = lay[:, 0].contiguous(), lay[:, 1].contiguous(), lay[:, 3].contiguous()
    c2w, K = torch.from_numpy(np.array(scene.c2w)), torch.from_numpy(np.array(scene.intrinsics))
    g = torch.Generator().manual_seed(seed)
    P = cache.num_pixels
    while True:
        pid = torch.randint(0, P, (B,), generator=g)
        img = torch.searchsorted(off, pid, right=True) - 1
        local = pid - off[img]
        w = wid[img]
        row = torch.div(local, w, rounding_mode="floor")
        idx = torch.stack([cams[img], row, local - row * w], -1)
        o, d = rays_from_indices(c2w, K, idx)
        yield {"origins": o, "directions": d, "rgb": pixels[pid].float().div_(255.0), "indices": idx}


def _touch(b) -> float:
    return float(b["rgb"][-1, 0]) + float(b["directions"][0, 0])


def measure(it, rays_per_step: int, seconds: float, warmup: int = 3) -> float:
    """Rays/s delivered by iterator ``it`` (a consumer that only touches each batch)."""
    for _ in range(warmup):
        _touch(next(it))
    n = 0
    t0 = time.perf_counter()
    while True:
        _touch(next(it))
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds and n >= 3:
            return n * rays_per_step / dt


def _best_threads(fn) -> float:
    """max(fn() with torch's current thread count, fn() with 1 thread)."""
    n = torch.get_num_threads()
    best = fn()
    if n > 1:
        torch.set_num_threads(1)
        try:
            best = max(best, fn())
        finally:
            torch.set_num_threads(n)
    return best


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_worker(rank, scene, cache, B, seconds, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        plan = SamplingPlan.for_loader(B, rank=rank, world_size=2, num_threads=1, rays_per_run=B, prefetch=0)
        src = make_source("sync_global", scene, plan, cache=cache if rank == 0 else None)
        for _ in range(3):
            _touch(next(src))
        # both ranks run the same number of steps: rank 0 decides it from a short probe
        t0 = time.perf_counter()
        _touch(next(src))
        steps = torch.tensor([max(3, int(seconds / max(time.perf_counter() - t0, 1e-6)))])
        dist.broadcast(steps, 0)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(int(steps)):
            _touch(next(src))
        dt = time.perf_counter() - t0
        if rank == 0:
            Path(out).write_text(str(int(steps) * 2 * B / dt))
    finally:
        dist.destroy_process_group()


def sync_global_rate(scene, cache, B: int, seconds: float) -> float:
    """Rank 0's delivered global-batch rays/s with 2 gloo ranks (spawned processes)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rate")
        mp.start_processes(_global_worker, args=(scene, cache, B, seconds, _free_port(), out), nprocs=2,
                           join=True, start_method="spawn")
        return float(Path(out).read_text())


def synthetic_images(folder, fmt: str, n: int = 100, size: int = 800) -> Scene:
    """Write ``n`` synthetic ``size``^2 images (jpg: RGB q95 | jpg_gray: 1-component q95 | png:
    RGBA) into ``folder``; returns their Scene (identity cameras)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    paths = []
    for i in range(n):
        img = np.stack([np.sin(xx / (17 + i)) * 110 + 128, np.cos(yy / 23) * 110 + 128,
                        (xx + yy + 9 * i) % 256], -1).astype(np.uint8)
        if fmt == "png":
            a = (((xx // 50 + yy // 50 + i) % 3 > 0) * 255).astype(np.uint8)[..., None]
            img = np.concatenate([img, a], -1)
        if fmt == "jpg_gray":
            img = np.ascontiguousarray(img[:, :, 0])
        p = os.path.join(folder, f"{i:03d}.{'jpg' if fmt.startswith('jpg') else fmt}")
        cv2.imwrite(p, img, [cv2.IMWRITE_JPEG_QUALITY, 95] if fmt.startswith("jpg") else [])
        paths.append(p)
    return Scene(image_paths=paths, c2w=np.tile(np.eye(4)[:3], (n, 1, 1)),
                 intrinsics=np.tile([size, size, size / 2, size / 2], (n, 1)), width=[size] * n,
                 height=[size] * n, split="train", format="blender", root=str(folder))


def decode_rate(fmt: str, n: int = 100, size: int = 800, threads: int = 2, reps: int = 2, device: str = "cpu",
                scene=None) -> float:
    """Images/s of decode_cache on ``n`` synthetic ``size``^2 images (jpg RGB q95 | png RGBA; or
    the images of ``scene``, e.g. :func:`synthetic_images`'): the best of ``reps`` timed calls
    after a warm one. Each call builds its own DALI pipeline (~5 ms on the CPU, included): ``n`` =
    100 is a realistic dataset, where that is ~1% of the time. ``device="cuda"``: DALI's mixed
    decoder (nvJPEG for JPEG) into device memory, timed until the device has finished
    (``torch.cuda.synchronize``)."""
    if scene is None:
        with tempfile.TemporaryDirectory() as d:
            return decode_rate(fmt, n, size, threads, reps, device, synthetic_images(d, fmt, n, size))
    done = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    decode_cache(scene, num_threads=threads, device=device)  # warm (page cache, first pipeline)
    done()
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        decode_cache(scene, num_threads=threads, device=device)
        done()
        best = max(best, scene.num_images / (time.perf_counter() - t0))
    return best


def measure_table(scene, batches, seconds: float, rounds: int = 3, n_dec: int = 100, stream: str = "global") -> dict:
    """Every source's delivered rays/s at each of ``batches`` on ``scene`` (the best of ``rounds``
    interleaved rounds of ``seconds``), SS routed to cell 0 of a 2x2 grid (scenes with near/far),
    and the decoder's images/s: {"rows": [{"rays", "rates": {source: rays/s}}], "ss": [{"rays",
    "rate", "share", "acceptance"}], "decode": {"images", "jpeg", "png"}, "scene": {"images",
    "pixels"}, "cores", "threads", "rounds", "seconds", "stream"} (:func:`table_markdown` prints it)."""
    cache = decode_cache(scene, 0, 1)
    print(f"scene: {scene}  ({cache.num_pixels / 1e6:.1f} M pixels cached, {rounds} rounds of {seconds:g} s "
          f"per source)", flush=True)
    # one sampling budget for every source: the DALI loaders get as many threads as torch's intra-op
    # pool and the torch_workers processes (the loaders' own default, hostbudget, keeps a core for
    # the training thread, which this benchmark does not have)
    threads = torch.get_num_threads()
    part = None
    if scene.has_bounds:  # spatial segmentation: a 2x2 grid over the cameras, routed to cell 0
        part = Partition.from_config(PartitionConfig(kind="grid", grid=[2, 2]), scene)
    rows, ss = [], []
    for B in batches:
        # every source is measured once per round, the rounds interleaved, and keeps its best
        # round: on a machine whose speed drifts, each source gets the same chance at its fast
        # patches (and no source is measured only in a slow one)
        r = {k: 0.0 for k in ("rays", "torch_gather", "sync_local", "torch_workers", "sync_global")}
        best_ss, acc = 0.0, None
        # the benchmark's own budget, the same for every source (see above)
        plan = SamplingPlan.for_loader(B, num_threads=threads, rays_per_run=max(262144, B), prefetch=2, workers=threads,
                                       stream=stream)
        cell0 = SamplingPlan.for_loader(B, num_threads=threads, rays_per_run=max(262144, B), prefetch=2,
                                        cells=(0,), num_cells=part.num_cells) if part is not None else None
        for _ in range(rounds):
            with make_source("rays", scene, plan, cache=cache) as L:
                r["rays"] = max(r["rays"], measure(L, B, seconds))
            if part is not None:
                with make_source("rays", scene, cell0, cache=cache, partition=part) as S:
                    best_ss = max(best_ss, measure(S, B, seconds))
                    acc = S.stats()["acceptance"]
            # training-thread torch samplers: best of torch's default intra-op threads and 1 thread
            # (on a shared/oversubscribed machine 2 OpenMP threads can be 10x slower than 1)
            r["torch_gather"] = max(r["torch_gather"], _best_threads(
                lambda: measure(torch_gather_source(cache, scene, B), B, seconds)))
            r["sync_local"] = max(r["sync_local"], _best_threads(
                lambda: measure(make_source("sync_local", scene, plan, cache=cache), B, seconds)))
            with make_source("torch_workers", scene, plan, cache=cache) as tw:
                r["torch_workers"] = max(r["torch_workers"], measure(tw, B, seconds))
            r["sync_global"] = max(r["sync_global"], sync_global_rate(scene, cache, B, seconds))
        if part is not None:
            ss.append({"rays": B, "rate": best_ss, "share": best_ss / r["rays"], "acceptance": acc})
        rows.append({"rays": B, "rates": r})
        print(f"B={B}: " + ", ".join(f"{k} {v / 1e6:.2f} M/s" for k, v in r.items()), flush=True)
    return {"rows": rows, "ss": ss, "decode": {"images": n_dec, "jpeg": decode_rate("jpg", n=n_dec),
                                               "png": decode_rate("png", n=n_dec)},
            "scene": {"images": scene.num_images, "pixels": cache.num_pixels}, "cores": os.cpu_count(),
            "threads": threads, "rounds": rounds, "seconds": seconds, "stream": stream}


SOURCES = ("rays", "torch_gather", "sync_local", "sync_global", "torch_workers")
"""The table's columns, in order (RayLoader first)."""


def table_markdown(res: dict) -> str:
    """The markdown table of :func:`measure_table`'s result (rates, ratios of ours to each, SS, decode)."""
    lines = ["| rays/step | " + " | ".join(f"{n} Mrays/s" for n in SOURCES) + " |", "|---:|" + "---:|" * len(SOURCES)]
    for row in res["rows"]:
        r = row["rates"]
        cells = [f"{r['rays'] / 1e6:.1f}"] + [f"{r[n] / 1e6:.2f} ({r['rays'] / r[n]:.1f}x)" for n in SOURCES[1:]]
        lines.append(f"| {row['rays']} | " + " | ".join(cells) + " |")
    for x in res["ss"]:
        lines += ["", f"SS at {x['rays']} rays/step: SpatialRayLoader (2x2 grid over the cameras, margin 1.15, routing box = "
                  f"the scene box), cell 0: {x['rate'] / 1e6:.1f} Mrays/s = {x['share']:.0%} "
                  f"of RayLoader (both the best of the same rounds; routing acceptance {x['acceptance']:.2f})."]
    d, t = res["decode"], res["threads"]
    lines += ["", f"Decode (decode_cache: DALI CPU decoder, 2 threads, {d['images']} images of 800x800 into the ImageCache, "
              f"pipeline build included, best of 2): JPEG {d['jpeg']:.0f} images/s, PNG RGBA {d['png']:.0f} images/s.", "",
              f"Scene: {res['scene']['images']} images, {res['scene']['pixels'] / 1e6:.1f} M pixels; {res['cores']} CPU cores; "
              f"each source: the best of {res['rounds']} interleaved rounds of {res['seconds']:g} s; RayLoader's stream: "
              f"{res['stream']}; (Nx) = RayLoader's rate / that "
              f"source's; RayLoader and the SS loader: {t} DALI threads, torch_workers: {t} worker processes, torch_gather "
              f"and sync_local: best of 1 and the default torch threads ({t}); sync_global = rank 0's "
              f"global batch (2 ranks, gloo)."]
    return "\n".join(lines)


def main(args) -> int:
    try:
        batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--batches {args.batches!r}: use comma-separated integers, e.g. 4096,65536") from None
    if not batches or min(batches) <= 0:
        raise ConfigError(f"--batches {args.batches!r}: batch sizes must be > 0")
    seconds = float(args.seconds)
    if not seconds > 0:
        raise ConfigError(f"--seconds {args.seconds}: must be > 0")
    rounds = int(getattr(args, "rounds", 3))
    if rounds <= 0:
        raise ConfigError(f"--rounds {rounds}: must be > 0")
    n_dec = int(getattr(args, "decode_images", 100))
    if n_dec <= 0:
        raise ConfigError(f"--decode-images {n_dec}: must be > 0")
    stream = getattr(args, "stream", "global")
    scene = load_scene(args.scene, split="train") if args.scene else default_scene()
    if getattr(args, "mask", None) is not None:  # masked against unmasked RayLoader, nothing else
        from dali_nerf.bench.masked import mask_main

        return mask_main(args, scene, measure)
    table = table_markdown(measure_table(scene, batches, seconds, rounds, n_dec, stream))
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("# dali-nerf bench sampler\n\n" + table + "\n")
    return 0
