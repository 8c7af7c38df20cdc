"""Throughput of the dali_nerf ray-sampler op (CPU backend, or GPU with --gpu), in Mrays/s.

Cache: ``--images`` random-content images of ``--res`` x ``--res`` pixels (default 100 x 400x400,
a Blender-scene-sized cache), cameras on a sphere of radius 4 looking at the origin, near 2,
far 6. Modes: random, epoch, and routed (random stream routed to cell 0 of a 2x2 grid of
centroids at (+-1.5, 0, +-1.5), margin 1.15, dims 2). Each pipeline run samples ``rays``. The
modes are measured interleaved (8 rounds of ``--seconds / 8`` each), so that their ratios,
printed last, are not at the mercy of a machine whose speed drifts (each round runs them in a
rotated order, so none always runs first). ``--route-tile 0,4,8`` runs the routed mode once per
tile side of the op's routing tile map (0: every ray tested exactly), interleaved with the others.

``--worlds 1,2,4,8,16`` compares instead, for each world size W and each of ``--modes`` random
and epoch, the cache's own per-rank stream (``stream``/``num_streams`` = 0/W: ``rays`` rays per
run) with the split's global stream (``global_pixels`` = W x the cache's pixels, the cache being
rank W // 2's shard: each run walks W x ``rays`` global positions and keeps about ``rays``), on
the same cache, all interleaved in rotated rounds. The rate is kept rays per second per thread
(wall clock) and per CPU-second; the last column is global / per-rank.

    python benchmarks/op_throughput.py --rays 4096,262144 --seconds 2
    python benchmarks/op_throughput.py --worlds 1,2,4,8,16 --modes random,epoch --rays 65536 --seconds 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dali_nerf.data import hostmem
from dali_nerf.pipelines.rays import pixel_feed


def make_cache(n_images: int, res: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    P = n_images * res * res
    pixels = hostmem.empty((P, 3), np.uint8)  # like the loader's ImageCache (huge pages)
    pixels[:] = rng.integers(0, 256, size=(P, 3), dtype=np.uint8)
    cams = np.zeros((n_images, 18), np.float32)
    for i in range(n_images):
        z = rng.normal(size=3)
        z[1] = abs(z[1]) * 0.5
        z /= np.linalg.norm(z)                     # camera backward axis (looks at the origin)
        x = np.cross([0.0, 1.0, 0.0], z)
        x /= np.linalg.norm(x)
        y = np.cross(z, x)
        c2w = np.stack([x, y, z, 4.0 * z], axis=1)  # (3, 4)
        cams[i, :12] = c2w.ravel()
        cams[i, 12:18] = [res * 1.1, res * 1.1, res / 2, res / 2, 2.0, 6.0]
    lay = np.stack([np.arange(n_images) * res * res, np.full(n_images, res), np.full(n_images, res),
                    np.arange(n_images)], axis=1).astype(np.int64)
    return pixels, cams, lay


CENTROIDS = np.array([[-1.5, 0, -1.5], [1.5, 0, -1.5], [-1.5, 0, 1.5], [1.5, 0, 1.5]], np.float32)


class Runner:
    """One synchronous pipeline of the op in one mode; ``step()`` runs it once."""

    def __init__(self, cache, rays: int, mode: str, routed: bool, threads: int, gpu: bool, route_tile=None,
                 stream_args=None):
        from nvidia.dali import fn, pipeline_def

        pixels, cams, lay = cache
        self.rays, self.start = rays, 0
        self.n = self.used = self.kept = self.measured = 0  # measured: rays emitted by measured runs
        self.wall = self.cpu = 0.0

        def next_start():
            return [np.array(self.start, np.int64)]

        @pipeline_def(batch_size=1, num_threads=threads, device_id=0 if gpu else None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipe():
            def const(a):
                return lambda: [a]

            px = pixel_feed(pixels, gpu)

            # --gpu: the pixels are device-resident (moved once in main(), fed as one (1, P, 3)
            # batch without a copy, pixel_feed);
            # cameras, layout and centroids stay CPU inputs of the GPU op (its host-side checks
            # and tables need them on the host)
            ins = [fn.external_source(source=lambda: px, batch=True, no_copy=True,
                                      device="gpu" if gpu else "cpu")]
            ins += [fn.external_source(source=const(a), batch=True, no_copy=True, device="cpu") for a in (cams, lay)]
            if routed:
                ins.append(fn.external_source(source=lambda: [CENTROIDS], batch=True, no_copy=True, device="cpu"))
            s = fn.external_source(source=next_start, batch=True)
            kw = dict(cell=0, margin=1.15) if routed else {}
            if routed and route_tile is not None:
                kw["route_tile"] = route_tile
            kw.update(stream_args or {})
            out = fn.dali_nerf.ray_sampler(*ins, rays=rays, mode=mode, seed=1, start=s,
                                           device="gpu" if gpu else "cpu", **kw)
            return tuple(out)

        self.gpu = gpu
        self.pp = pipe()
        self.pp.build()
        for _ in range(3):  # warm-up, not counted
            self._run()

    def _run(self) -> int:
        out = self.pp.run()
        consumed = out[6].as_cpu() if self.gpu else out[6]
        c = int(np.array(consumed[0])[0])
        self.start += c
        self.kept += int(out[0].shape()[0][0])  # rays emitted (fewer than consumed: routed, global)
        return c

    def measure(self, seconds: float) -> None:
        """Run for about ``seconds`` (at least one run) and add to the totals."""
        t0, c0, n = time.perf_counter(), time.process_time(), 0
        kept0 = self.kept
        while n == 0 or time.perf_counter() - t0 < seconds:
            self.used += self._run()
            n += 1
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        self.n += n
        self.measured += self.kept - kept0

    def result(self):
        """(Mrays/s, acceptance, Mrays per CPU-second), rays = the rays emitted."""
        rays = self.measured
        return rays / self.wall / 1e6, rays / self.used, rays / self.cpu / 1e6


def run_rounds(runners, seconds: float, rounds: int = 8) -> None:
    """``rounds`` rounds, each running every runner for ``seconds / rounds``; round k starts with
    runner k (mod their number), so none always runs first or last after the same neighbour."""
    for k in range(rounds):
        for j in range(len(runners)):
            runners[(k + j) % len(runners)].measure(seconds / rounds)


def measure(cache, rays: int, modes, seconds: float, threads: int, gpu: bool, rounds: int = 8):
    """Interleaved measurement of several modes (:func:`run_rounds`), so that a slow patch of the
    machine hits all modes alike and their ratios compare like with like. ``modes``: list of
    (mode, routed, route_tile or None). Returns their results."""
    runners = [Runner(cache, rays, m, r, threads, gpu, t) for m, r, t in modes]
    run_rounds(runners, seconds, rounds)
    res = [rn.result() for rn in runners]
    del runners
    return res


def compare_streams(cache, rays: int, modes, worlds, seconds: float, threads: int, gpu: bool,
                    rounds: int = 8):
    """Per-rank stream vs the split's global stream on the same cache, for each mode and world
    size W (module docstring). Returns {(mode, W): (per-rank result, global result)}."""
    P = len(cache[0])
    runners = {}
    for mode in modes:
        for W in worlds:
            per_rank = Runner(cache, rays, mode, False, threads, gpu,
                              stream_args=dict(stream=0, num_streams=W))
            glob = Runner(cache, rays * W, mode, False, threads, gpu,
                          stream_args=dict(global_pixels=P * W, shard_begin=P * (W // 2), step_positions=rays * W))
            runners[(mode, W)] = (per_rank, glob)
    run_rounds([r for pair in runners.values() for r in pair], seconds, rounds)
    res = {k: (a.result(), b.result()) for k, (a, b) in runners.items()}
    del runners
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rays", default="4096,262144")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--res", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="GPU backend (needs the CUDA plugin)")
    ap.add_argument("--modes", default="random,epoch,routed",
                    help="comma-separated subset of random, epoch, routed")
    ap.add_argument("--route-tile", default="",
                    help="comma-separated route_tile values for the routed mode (default: the op's)")
    ap.add_argument("--worlds", default="",
                    help="comma-separated world sizes: compare the per-rank stream with the global "
                         "stream (random, epoch) instead")
    args = ap.parse_args(argv)

    from dali_nerf.ops import load_plugin

    path = load_plugin(cuda=True if args.gpu else None)
    cache = make_cache(args.images, args.res)
    if args.gpu:  # the images resident in device memory, copied there once
        cache = (torch.from_numpy(cache[0]).cuda(), cache[1], cache[2])
    print(f"plugin {path}\ncache {args.images} x {args.res}x{args.res} = {len(cache[0])} pixels, "
          f"threads {args.threads}, backend {'gpu' if args.gpu else 'cpu'}")
    keys = args.modes.split(",")
    if args.worlds:
        worlds = [int(w) for w in args.worlds.split(",")]
        if any(k not in ("random", "epoch") for k in keys) or any(w < 1 for w in worlds):
            raise SystemExit("--worlds: use --modes random and/or epoch, and world sizes >= 1")
        print("| mode | W | rays/run | per-rank Mrays/s/thread | global Mrays/s/thread | per-rank Mrays/CPU-s | "
              "global Mrays/CPU-s | global / per-rank |\n|---|---|---|---|---|---|---|---|")
        for rays in [int(r) for r in args.rays.split(",")]:
            res = compare_streams(cache, rays, keys, worlds, args.seconds, args.threads, args.gpu)
            for (mode, W), (a, b) in res.items():
                print(f"| {mode} | {W} | {rays} | {a[0] / args.threads:.2f} | {b[0] / args.threads:.2f} | "
                      f"{a[2]:.2f} | {b[2]:.2f} | {b[2] / a[2]:.0%} |", flush=True)
        return
    # Mrays per CPU-second (process time, all threads) is less sensitive to other load than the
    # wall-clock rate; on an idle machine with --threads 2 it is about half of Mrays/s
    print("| mode | rays/run | Mrays/s | Mrays/CPU-s | acceptance |\n|---|---|---|---|---|")
    for key in keys:
        if key not in ("random", "epoch", "routed"):
            raise SystemExit(f"--modes: unknown mode {key!r}: use random, epoch or routed")
    tiles = [int(t) for t in args.route_tile.split(",")] if args.route_tile else [None]
    runs = []  # (row name, ratio-row suffix or None, (mode, routed, route_tile))
    for key in keys:
        if key != "routed":
            runs.append((key, None, (key, False, None)))
            continue
        for t in tiles:
            tag = "" if t is None else f", route_tile {t}"
            runs.append((f"routed 2x2 (cell 0{tag})", tag, ("random", True, t)))
    for rays in [int(r) for r in args.rays.split(",")]:
        results = measure(cache, rays, [m for _, _, m in runs], args.seconds, args.threads, args.gpu)
        for (name, _, _), (mrays, acc, per_cpu) in zip(runs, results):
            print(f"| {name} | {rays} | {mrays:.1f} | {per_cpu:.1f} | {acc:.3f} |", flush=True)
        if "random" in keys:
            base = results[[n for n, _, _ in runs].index("random")]
            for (_, tag, _), res in zip(runs, results):
                if tag is not None:
                    print(f"| routed / random{tag} | {rays} | {res[0] / base[0]:.0%} | "
                          f"{res[2] / base[2]:.0%} | |", flush=True)


if __name__ == "__main__":
    main()
