"""``dali-nerf bench sampler --mask F``: what masks cost the ray sampler, per ray.

The benchmark scene's images get masks (written once per run into a temporary folder) that mask a
fraction F of every image: ``--mask-kind iid`` (default; every pixel masked with probability F,
the hardest case for the valid-pixel index: no long runs) or ``sky`` (the top F of every image, a
sky segmentation). RayLoader (the same plan as ``bench sampler``'s ``rays``: prefetch 2, 262144
rays per run, ``--stream``) over the unmasked and the masked cache is measured in ``--rounds``
interleaved rounds (the order alternating each round), each keeping its best round; the table
gives both rates and the masked cost per ray (unmasked rate / masked rate; the aim is <= 1.2x), of
the best rounds and round by round (each round's two runs are adjacent: the median and the range
of those paired ratios are the spread the machine's drift leaves).

    dali-nerf bench sampler --mask 0.5 --seconds 2 --rounds 5
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch

from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import SamplingPlan
from dali_nerf.errors import ConfigError
from dali_nerf.sources import make_source

__all__ = ["mask_main", "masked_scene", "cost_row", "MASK_KINDS"]

MASK_KINDS = ("iid", "sky")


def masked_scene(scene, folder, fraction: float, kind: str = "iid", seed: int = 0):
    """``scene`` with one mask per image written into ``folder``: ``fraction`` of each image's
    pixels masked (iid, or its top rows: ``sky``)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(scene.num_images):
        w, h = int(scene.width[i]), int(scene.height[i])
        if kind == "iid":
            m = rng.random((h, w)) >= fraction
        else:
            m = np.ones((h, w), bool)
            m[:int(round(fraction * h))] = False
        p = os.path.join(folder, f"mask_{i:05d}.png")
        if not cv2.imwrite(p, m.astype(np.uint8) * 255):
            raise ConfigError(f"{p}: could not write a benchmark mask")
        paths.append(p)
    return dataclasses.replace(scene, mask_paths=paths, mask_wh=np.stack([scene.width, scene.height], 1))


def cost_row(rays: int, none: list, masked: list) -> str:
    """The table row of ``rays`` per step from the rounds' rates (rays/s; ``none[r]`` and
    ``masked[r]`` measured next to each other in round r): the best rates, the cost of the best
    (best unmasked / best masked) and the paired costs' median (min-max) over the rounds."""
    if not none or len(none) != len(masked):
        raise ValueError(f"cost_row: {len(none)} unmasked and {len(masked)} masked rounds: give one pair per round")
    paired = np.asarray(none, float) / np.asarray(masked, float)
    return (f"| {rays} | {max(none) / 1e6:.1f} | {max(masked) / 1e6:.1f} | {max(none) / max(masked):.2f}x | "
            f"{np.median(paired):.2f}x ({paired.min():.2f}-{paired.max():.2f}) |")


def mask_main(args, scene, measure) -> int:
    """The masked-vs-unmasked comparison of ``bench sampler --mask`` (``measure``: the sampler
    benchmark's consumer loop)."""
    fraction, kind = float(args.mask), getattr(args, "mask_kind", "iid")
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"--mask {args.mask}: the masked fraction must be in (0, 1), e.g. 0.5")
    if kind not in MASK_KINDS:
        raise ConfigError(f"--mask-kind {kind!r}: use {' or '.join(MASK_KINDS)}")
    batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    seconds, rounds, stream = float(args.seconds), int(args.rounds), getattr(args, "stream", "global")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as d:
        masked = masked_scene(scene, d, fraction, kind)
        scenes = {"none": scene, "masked": masked}
        one = SamplingPlan.for_loader(batches[0], num_threads=threads)  # one rank: the whole split, decoded once
        caches = {k: CacheStore(v, one).full("cpu") for k, v in scenes.items()}
        share = caches["masked"].num_valid / caches["masked"].num_pixels
        print(f"scene: {scene}  ({caches['none'].num_pixels / 1e6:.1f} M pixels; masks: {kind}, "
              f"{1 - share:.1%} masked)", flush=True)
        lines = ["| rays/step | unmasked Mrays/s | masked Mrays/s | masked cost per ray | per round: median (min-max) |",
                 "|---:|---:|---:|---:|---:|"]
        for B in batches:
            plan = SamplingPlan.for_loader(B, num_threads=threads, rays_per_run=max(262144, B), prefetch=2,
                                           stream=stream)
            rates = {"none": [], "masked": []}
            for r in range(rounds):  # interleaved, the order alternating: neither always runs first
                for which in (("none", "masked") if r % 2 == 0 else ("masked", "none")):
                    with make_source("rays", scenes[which], plan, cache=caches[which]) as L:
                        rates[which].append(measure(L, B, seconds))
            lines.append(cost_row(B, rates["none"], rates["masked"]))
            print(lines[-1], flush=True)
    lines += ["", f"Scene: {scene.num_images} images, {caches['none'].num_pixels / 1e6:.1f} M pixels, masks {kind} "
              f"({1 - share:.1%} of the pixels masked); RayLoader, stream {stream}, {threads} DALI threads, prefetch 2, "
              f"{max(262144, batches[0])} rays per run; each: the best of {rounds} interleaved rounds of {seconds:g} s "
              f"(order alternating); {os.cpu_count()} CPU cores; cost per ray = unmasked rate / masked rate (of the "
              f"best rounds; per round: the two runs of each round paired)."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("# dali-nerf bench sampler --mask\n\n" + table + "\n")
    return 0
