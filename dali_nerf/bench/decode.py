"""``dali-nerf bench decode``: decode throughput (images/s) of DALI's CPU decoder on this host's
cores and, on a GPU, of DALI's mixed decoder (nvJPEG for JPEG) into device memory.

    dali-nerf bench decode --images 100 --size 800 --threads 0 --out out/decode

Each number is :func:`dali_nerf.bench.sampler.decode_rate`: ``decode_cache`` of ``--images``
synthetic ``--size`` x ``--size`` images (JPEG q95 RGB, PNG RGBA, and with ``jpg_gray`` in
``--formats`` JPEG q95 1-component, which the cache decodes with OpenCV in the calling thread, on
every device, so ``--threads`` does not apply to it; the same files for every decoder of a format),
the best of ``--reps`` timed calls after a warm one, the pipeline's build
included (each call builds one); the GPU's ends when the device has finished.
``--threads`` lists the CPU decoder's thread counts (0 = all cores); the mixed decoder uses the
largest (its host stages). Writes ``decode.json`` (``rows``: format, decoder, threads, images/s)
and prints a table.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from dali_nerf.atomic import atomic_write_text
from dali_nerf.errors import ConfigError
from dali_nerf.bench.sampler import decode_rate, synthetic_images

__all__ = ["main", "measure"]


def measure(formats, n: int, size: int, threads, reps: int, out=None, log=print) -> dict:
    """{"meta", "rows", "skipped"}: images/s per format and decoder (see the module docstring);
    ``out/decode.json`` rewritten after every row when ``out`` is given."""
    cores = os.cpu_count() or 1
    threads = sorted({cores if t == 0 else int(t) for t in threads})
    res = {"meta": {"images": n, "size": size, "host_cores": cores, "reps": reps,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
           "rows": [], "skipped": []}
    if not torch.cuda.is_available():
        res["skipped"].append("mixed (nvJPEG) decoder: no GPU visible to torch")

    def put(fmt, decoder, th, rate):
        res["rows"].append({"format": fmt, "decoder": decoder, "threads": th, "images_per_s": rate})
        log(f"{fmt:8s} {decoder:22s} {th:3d} threads: {rate:8.0f} images/s")
        if out is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(out) / "decode.json", json.dumps(res, indent=1))

    for fmt in formats:
        with tempfile.TemporaryDirectory() as d:
            scene = synthetic_images(d, fmt, n, size)  # one set of files for every decoder of this format
            for th in threads:
                put(fmt, "OpenCV" if fmt == "jpg_gray" else "cpu", th, decode_rate(fmt, threads=th, reps=reps, scene=scene))
            if torch.cuda.is_available():
                put(fmt, {"jpg": "mixed (nvJPEG)", "jpg_gray": "OpenCV, GPU finish"}.get(fmt, "mixed"), max(threads),
                    decode_rate(fmt, threads=max(threads), reps=reps, device="cuda", scene=scene))
    if out is not None:
        atomic_write_text(Path(out) / "decode.json", json.dumps(res, indent=1))
    return res


def main(args) -> int:
    """``dali-nerf bench decode``."""
    formats = [f.strip() for f in str(args.formats).split(",") if f.strip()]
    for f in formats:
        if f not in ("jpg", "png", "jpg_gray"):
            raise ConfigError(f"--formats: {f!r}; use a comma-separated list of jpg, png, jpg_gray")
    try:
        threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--threads {args.threads!r}: use comma-separated integers (0 = all cores)") from None
    if not threads or min(threads) < 0:
        raise ConfigError(f"--threads {args.threads!r}: give thread counts >= 0 (0 = all cores)")
    for name, v in (("--images", args.images), ("--size", args.size), ("--reps", args.reps)):
        if v <= 0:
            raise ConfigError(f"{name} {v}: must be > 0")
    res = measure(formats, args.images, args.size, threads, args.reps, out=args.out)
    if res["skipped"]:
        print("not measured: " + "; ".join(res["skipped"]))
    return 0
