"""The dali-nerf command: one subcommand per job, each in its own module, imported only when used
(:data:`_COMMANDS`); ``dali-nerf --help`` lists them with the one-line summaries of :data:`SUMMARIES`.
User errors print ``error: <one line>`` and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib

from dali_nerf.cli.command import run_cli
from dali_nerf.interrupt import exit_process

__all__ = ["main", "entry"]


# subcommand -> "module:function"; the function takes the parsed argparse.Namespace
_COMMANDS = {
    "demo": "dali_nerf.cli.demo:main",
    "train": "dali_nerf.cli.train:main",
    "make-scene": "dali_nerf.scenegen:main",
    "validate": "dali_nerf.cli.validate:main",
    "render": "dali_nerf.cli.render:main",
    "bench": "dali_nerf.bench:main",
    "build-op": "dali_nerf.ops:main",
}


SUMMARIES = {
    "demo": "the main job: generate the default scene, train 2 DDP ranks, render, report",
    "train": "train a config (its method: DDP or SS) under torchrun; --list shows the shipped configs",
    "make-scene": "generate a multi-view scene with known cameras (objects | city | forward | unbounded)",
    "validate": "scan a scene folder (every image header) before training",
    "render": "render a split or an orbit from a DDP or SS run's checkpoint",
    "bench": "benchmarks: sampler | study | loop | decode | images (docs/BENCHMARKS.md)",
    "build-op": "build (or rebuild) the C++ ray sampler operator now",
}
"""One line per subcommand: ``dali-nerf --help`` and each subcommand's own help."""

_DESCRIPTION = "dali-nerf: NeRF training fed by a DALI ray sampler that runs ahead of the training loop."
_EPILOG = ("Run 'dali-nerf COMMAND --help' for a command's options. Errors in your input print one line "
           "and exit with code 2.")


def _help_text() -> str:
    width = max(len(n) for n in SUMMARIES)
    return "\n".join([_DESCRIPTION, "", "commands:"] + [f"  {n:<{width}}  {h}" for n, h in SUMMARIES.items()])


def _bench_parsers(bsub) -> None:
    """The ``dali-nerf bench`` subcommands and their options."""
    bs = bsub.add_parser("sampler", help="sampler throughput table (rays/s) and decode images/s")
    bs.add_argument("--scene", default=None, help="scene folder (default: generate a 100-image 400x400 one)")
    bs.add_argument("--batches", default="4096,65536")
    bs.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    bs.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds; each source keeps its best (default 3)")
    bs.add_argument("--out", default=None, help="also write the table (markdown) here")
    bs.add_argument("--decode-images", type=int, default=100, help="800x800 images per decode measurement")
    bs.add_argument("--stream", choices=("global", "shard"), default="global",
                    help="RayLoader's stream (default global: the trainers' pipeline.stream; shard: the per-rank "
                         "stream, what this benchmark measured before the global stream)")
    bs.add_argument("--mask", type=float, default=None, metavar="F",
                    help="measure masks instead: RayLoader with a fraction F of every image masked against none, "
                         "interleaved rounds (the cost per ray)")
    bs.add_argument("--mask-kind", choices=("iid", "sky"), default="iid",
                    help="with --mask: pixels masked at random (iid, default) or the top F of every image (sky)")
    bt = bsub.add_parser("study", help="the characterization study: DDP vs SS x samplers x ranks")
    bt.add_argument("--config", default="study", help="a YAML file or a shipped config's name (default: study)")
    bt.add_argument("--quotes", action="store_true",
                    help="also write the report's quoted sentences into README.md and docs/BENCHMARKS.md (of "
                         "--checkout), when every cell ran")
    bt.add_argument("--checkout", default=".", help="the checkout --quotes writes into (default: this folder)")
    bt.add_argument("overrides", nargs="*")
    bl = bsub.add_parser("loop", help="the training loop's step, wait and stall per source vs a ready-batch floor")
    bl.add_argument("--config", default="ddp_blender_gpu",
                    help="a YAML file or a shipped config's name (default: ddp_blender_gpu)")
    bl.add_argument("--scene", default=None, help="scene folder (default: the config's scene.path)")
    bl.add_argument("--batches", default="16384,65536", help="rays per step, comma-separated")
    bl.add_argument("--samplers", default="rays,rays_sync,sync_local,sync_global,torch_workers,ready")
    bl.add_argument("--placements", default="host,device",
                    help="host (images in host memory, CPU sampling) and/or device (images in GPU memory)")
    bl.add_argument("--trials", type=int, default=3)
    bl.add_argument("--steps", type=int, default=16, help="timed steps per source and trial")
    bl.add_argument("--warmup", type=int, default=5, help="untimed steps per source and trial")
    bl.add_argument("--pretrain", type=int, default=100, help="steps trained before timing (occupancy culling)")
    bl.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    bl.add_argument("--out", default="runs/bench_loop", help="folder for loop.json and loop.md")
    bl.add_argument("overrides", nargs="*", help="key=value config overrides")
    bi = bsub.add_parser("images", help="image batches for splatting trainers: ImageLoader vs gsplat's worker and cache paths")
    bi.add_argument("--scene", default=None, help="COLMAP scene folder (default: a synthetic one of --images PNGs)")
    bi.add_argument("--images", type=int, default=200)
    bi.add_argument("--width", type=int, default=800)
    bi.add_argument("--height", type=int, default=600)
    bi.add_argument("--ranks", default="1,2,4", help="ranks of the node, comma-separated")
    bi.add_argument("--trials", type=int, default=3)
    bi.add_argument("--batches", type=int, default=200, help="timed batches per rank (throughput and stall each, in each regime: first phase, steady state)")
    bi.add_argument("--warmup", type=int, default=10)
    bi.add_argument("--step-ms", dest="step_ms", type=float, default=10.0, help="emulated device step")
    bi.add_argument("--seed", type=int, default=0)
    bi.add_argument("--timeout", type=float, default=3600.0, help="seconds per (path, ranks) run")
    bi.add_argument("--out", default="runs/bench_images", help="folder for images.json and images.md")
    bd = bsub.add_parser("decode", help="decode images/s: the CPU decoder on this host's cores and nvJPEG")
    bd.add_argument("--images", type=int, default=100)
    bd.add_argument("--size", type=int, default=800, help="width = height in pixels")
    bd.add_argument("--threads", default="0", help="CPU decoder threads, comma-separated (0 = all cores)")
    bd.add_argument("--formats", default="jpg,png", help="comma-separated: jpg (RGB), png (RGBA), jpg_gray "
                    "(1-component JPEG, decoded by OpenCV)")
    bd.add_argument("--reps", type=int, default=2)
    bd.add_argument("--out", default=None, help="also write decode.json here (a folder)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dali-nerf", usage="dali-nerf [-h] COMMAND ...", description=_help_text(), epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="dali-nerf")

    def add(name):
        return sub.add_parser(name, help=SUMMARIES[name], description=SUMMARIES[name])

    d = add("demo")
    d.add_argument("--config", default=None,
                   help="a YAML file or a shipped config's name (default: ddp_objects; dali-nerf train --list)")
    d.add_argument("--data", default="data/default", help="scene folder (generated when missing)")
    d.add_argument("--nproc", type=int, default=2, help="ranks (processes) to train with")
    d.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. train.steps=200")

    from dali_nerf.cli.train import add_arguments as train_arguments

    train_arguments(add("train"))

    m = add("make-scene")
    m.add_argument("kind", choices=["objects", "city", "forward", "unbounded"])
    m.add_argument("--out", required=True, help="output folder")
    m.add_argument("--resolution", type=int, default=None, help="image width in pixels (objects: square; others: height = 3/4 width)")
    m.add_argument("--images", type=int, default=None, help="training images")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--jpeg", action="store_true", help="write JPEG instead of PNG (forward, unbounded: always JPEG)")
    m.add_argument("--format", choices=["native", "colmap"], default="native",
                   help="native: the kind's own layout; colmap: a COLMAP sparse model + images (splatting trainers)")
    m.add_argument("--force", action="store_true", help="overwrite an existing folder")
    m.add_argument("--occluders", action="store_true",
                   help="city, unbounded: a transient occluder in every image, masked (masks/, nerfstudio mask_path)")

    v = add("validate")
    v.add_argument("scene")
    v.add_argument("--format", default="auto")
    v.add_argument("--split", default=None, help="one split (default: all present)")

    r = add("render")
    r.add_argument("--checkpoint", required=True, help="checkpoint file or run folder")
    r.add_argument("--out", required=True, help="folder for the PNGs")
    r.add_argument("--split", default="test")
    r.add_argument("--orbit", type=int, default=0, help="render N orbit views instead of a split")
    r.add_argument("--max-images", type=int, default=0)

    _bench_parsers(add("bench").add_subparsers(dest="bench", required=True, metavar="BENCH"))

    o = add("build-op")
    o.add_argument("--cuda", action="store_true", help="also compile the CUDA variant with nvcc")
    o.add_argument("--force", action="store_true", help="rebuild even when cached")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    mod, fn = _COMMANDS[args.command].split(":")

    def call():
        return getattr(importlib.import_module(mod), fn)(args)

    return run_cli(call)


def entry() -> None:
    """The ``dali-nerf`` console script: :func:`main`, then :func:`~dali_nerf.interrupt.exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    entry()
