"""Checkpoint format 2 and resuming on another world size (dali_nerf/train/resume.py): the model and the
run state stored once per step, what resumes on W' ranks and what is refused (one line), format-1
checkpoints (one file per rank) resuming on their world size, and — under torchrun, gloo on the
CPU — a 4-rank run resumed on 2 and then on 3 ranks ending within 1e-4 dB of the uninterrupted
run's test PSNR."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dali_nerf.train.checkpoint import MODEL_FILE, RUN_FILE, commit_checkpoint, latest_checkpoint, load_file, save_file, save_rank_state
from dali_nerf.errors import DaliNerfError
from dali_nerf.train.resume import RUN_ID_FILE, load_checkpoint, nearest_divisors
from dali_nerf.scenegen import make_scene

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scene_dir(tmp_path_factory):
    return Path(make_scene("objects", tmp_path_factory.mktemp("elastic") / "scene", width=32, height=32, n_train=8,
                           n_val=1, n_test=2, seed=3))


def config(tmp_path, scene, name="run", extra="") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\nmethod: ddp\nscene:\n  path: {scene}\n"
                 f"pipeline:\n  rays_per_batch: 256\n  rays_per_run: 1024\n"
                 f"model:\n  resolution: 12\n  samples_per_ray: 12\n  occupancy_resolution: 0\n"
                 f"train:\n  steps: 12\n  checkpoint_every: 4\n  log_every: 4\n  eval_images: 1\n  device: cpu\n"
                 f"  runs_dir: {tmp_path / 'runs'}\n" + extra)
    return p


def ddp(cfg: Path, *args) -> int:
    from dali_nerf.trainers.ddp import main

    return main(["--config", str(cfg), *args])


def losses(run: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_a_checkpoint_stores_the_run_and_the_model_once(scene_dir, tmp_path):
    assert ddp(config(tmp_path, scene_dir), "train.steps=4") == 0
    folder = latest_checkpoint(tmp_path / "runs" / "run" / "checkpoints")
    assert sorted(p.name for p in folder.iterdir()) == [MODEL_FILE, RUN_FILE]
    run = load_file(folder, RUN_FILE)
    assert {k: run[k] for k in ("format", "step", "world_size", "method", "pipeline", "stream", "global_batch", "seed",
                                 "mode", "cells")} == {
        "format": 2, "step": 4, "world_size": 1, "method": "ddp", "pipeline": "rays", "stream": "global-v2",
        "global_batch": 256, "seed": 0, "mode": "random", "cells": 0}
    assert len(run["scene"]["names"]) == 8 and len(run["ranks"]) == 1 and set(run["ranks"][0]) == {"rng", "sources", "cells",
                                                                                         "replica"}
    assert run["ranks"][0]["sources"]["ddp"]["step"] == 4 and "field" not in run["ranks"][0]["sources"]["ddp"]
    assert set(load_file(folder, MODEL_FILE)["tasks"]["ddp"]) >= {"field", "optimizer", "scheduler", "space"}


def test_what_resumes_on_another_world_size_and_what_is_refused(scene_dir, tmp_path):
    """Global stream (G = 256): every rank of 2 or 4 gets the model and rank 0's loader state (the
    global step), no RNG (the new ranks are seeded afresh); 3 ranks do not divide G: refused,
    naming the divisors. Shard stream and sync_local: per-rank streams, refused on 2 ranks. Format
    1 (one file per rank, 2 ranks): refused on 3, rank 2 included (it has no file)."""
    for name, extra in (("glob", ""), ("shard", "  stream: shard\n"), ("local", "  name: sync_local\n")):
        cfg = config(tmp_path, scene_dir, name)
        cfg.write_text(cfg.read_text().replace("pipeline:\n", "pipeline:\n" + extra))
        assert ddp(cfg, "train.steps=4") == 0
    glob = latest_checkpoint(tmp_path / "runs" / "glob" / "checkpoints")
    for W in (2, 4):
        for r in range(W):
            st = load_checkpoint(glob, r, W)
            assert st["rng"] is None and st["tasks"]["ddp"]["source"]["step"] == 4 and "field" in st["tasks"]["ddp"]
    with pytest.raises(DaliNerfError, match=r"global batch of 256 rays \(256 per rank x 1 ranks\) does not divide among 3 "
                                            r"ranks.*divides 256: 2 or 4$"):
        load_checkpoint(glob, 0, 3)
    for name, what in (("shard", "pipeline.stream=shard"), ("local", "pipeline.name=sync_local")):
        folder = latest_checkpoint(tmp_path / "runs" / name / "checkpoints")
        assert load_checkpoint(folder, 0, 1)["rng"] is not None
        with pytest.raises(DaliNerfError, match=f"written by 1 ranks with {what}.*resumes on 1 ranks only, not 2"):
            load_checkpoint(folder, 1, 2)
    old = tmp_path / "old" / "step_0000004"
    for r in (0, 1):
        save_rank_state(old.parent, 4, r, {"step": 4, "rank": r, "world_size": 2, "tasks": {}, "rng": {}})
    assert load_checkpoint(old, 1, 2)["format"] == 1
    for r in (0, 2):
        with pytest.raises(DaliNerfError, match="saved with world size 2 in checkpoint format 1 .* not 3"):
            load_checkpoint(old, r, 3)


def _as_format_1(folder: Path) -> None:
    """Rewrite a 1-rank format-2 folder as format 1 wrote it (rank0.pt: step, rank, world_size,
    method, scene, tasks with the loader state, rng), from its own contents."""
    st = load_checkpoint(folder, 0)
    save_rank_state(folder.parent, st["step"], 0, {k: st[k] for k in ("step", "world_size", "method", "scene", "tasks",
                                                                      "rng")} | {"rank": 0})
    (folder / RUN_FILE).unlink()
    (folder / MODEL_FILE).unlink()


def test_a_format_1_checkpoint_resumes_on_its_world_size(scene_dir, tmp_path, capsys):
    """A shard-stream run stopped at step 8, its checkpoint rewritten in format 1, resumes with the
    trainers' default config (pipeline.stream global): the format-1 state continues the shard
    stream (a note says so), and steps 9-12 and the final field equal the uninterrupted run's."""
    full = config(tmp_path, scene_dir, "full")
    full.write_text(full.read_text().replace("pipeline:\n", "pipeline:\n  stream: shard\n"))
    assert ddp(full) == 0
    part = config(tmp_path, scene_dir, "part")
    part.write_text(part.read_text().replace("pipeline:\n", "pipeline:\n  stream: shard\n"))
    assert ddp(part, "train.stop_after=8") == 0
    run = tmp_path / "runs" / "part"
    _as_format_1(latest_checkpoint(run / "checkpoints"))
    default = config(tmp_path, scene_dir, "part")  # no pipeline.stream: the default, global
    capsys.readouterr()
    assert ddp(default, "--resume") == 0
    assert "a checkpoint of format 1 continues the shard stream: pipeline.stream=shard" in capsys.readouterr().err
    assert losses(run) == losses(tmp_path / "runs" / "full") and len(losses(run)) == 12
    a = load_checkpoint(latest_checkpoint(run / "checkpoints"))["tasks"]["ddp"]["field"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "full" / "checkpoints"))["tasks"]["ddp"]["field"]
    assert all(torch.equal(a[k], b[k]) for k in b)


# ------------------------------------------------------------------------------------ torchrun

TINY = ["model.resolution=20", "model.samples_per_ray=24", "model.occupancy_resolution=16", "model.occupancy_warmup=8",
        "model.occupancy_every=8", "model.hidden=16", "model.sigma_init=0.1", "model.occupancy_threshold=0.005",
        "model.density_components=8", "model.color_components=12"]


def _torchrun(nproc: int, scene, runs, name, *extra, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dali_nerf.trainers.ddp", "--config", "configs/ddp_objects.yaml", f"scene.path={scene}",
           f"train.runs_dir={runs}", f"name={name}", "train.steps=60", "train.checkpoint_every=20", "train.log_every=20",
           "train.eval_images=2", "train.lr=0.02", "pipeline.rays_per_run=6144", "train.device=cpu", *TINY, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    if check:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.mark.slow  # 5 torchrun launches of 2-5 CPU ranks: ~2-3 min on 2 busy cores
def test_four_ranks_resumed_on_two_then_three_match_the_uninterrupted_run(scene_dir, tmp_path):
    """G = 1536 rays a step: 4 ranks (384 each, from pipeline.global_batch; the uninterrupted run
    from pipeline.rays_per_batch) to step 20, resumed on 2 ranks (768) to step 40,
    then on 3 (512) to step 60, against 4 ranks uninterrupted: the final test PSNR within 1e-4 dB
    (measured: see docs/RELIABILITY.md), the final model's tensors allclose (rtol 1e-4, atol 1e-6),
    run.pt's loader position 60 x G, every step's metrics present once and each step's ranks' ray
    counts summing to G, the resumed runs' notes naming the kept global batch; 5 ranks do not
    divide G: refused in one line, nothing written."""
    runs = tmp_path / "runs"
    _torchrun(4, scene_dir, runs, "whole", "pipeline.rays_per_batch=384")
    _torchrun(4, scene_dir, runs, "moved", "pipeline.global_batch=1536", "train.stop_after=20")  # 384 a rank
    r2 = _torchrun(2, scene_dir, runs, "moved", "pipeline.rays_per_batch=384", "train.stop_after=40", "--resume")
    assert "its global batch of 1536 rays is kept on 2 ranks: pipeline.rays_per_batch=768 (was 384)" in r2.stderr
    r3 = _torchrun(3, scene_dir, runs, "moved", "pipeline.rays_per_batch=384", "--resume")
    assert "is kept on 3 ranks: pipeline.rays_per_batch=512 (was 768)" not in r3.stderr  # config.yaml is not read
    assert "is kept on 3 ranks: pipeline.rays_per_batch=512" in r3.stderr
    whole = json.loads((runs / "whole" / "summary.json").read_text())
    moved = json.loads((runs / "moved" / "summary.json").read_text())
    assert moved["world_size"] == 3 and moved["resumed_from"] == 40 and moved["rays_per_batch"] == 512
    gap = abs(moved["test_psnr"] - whole["test_psnr"])
    print(f"test PSNR: uninterrupted {whole['test_psnr']!r} dB, 4 -> 2 -> 3 ranks {moved['test_psnr']!r} dB, "
          f"gap {gap:.2e} dB; held-out mean colour {whole['mean_color_psnr']:.3f} dB")
    assert whole["test_psnr"] > whole["mean_color_psnr"] + 1.0, whole  # it learned: the comparison means something
    assert gap < 1e-4, (whole["test_psnr"], moved["test_psnr"])
    final = {n: latest_checkpoint(runs / n / "checkpoints") for n in ("whole", "moved")}
    assert [load_file(final[n], RUN_FILE)["ranks"][0]["sources"]["ddp"]["position"] for n in final] == [60 * 1536] * 2
    fields = [load_file(final[n], MODEL_FILE)["tasks"]["ddp"]["field"] for n in final]
    assert fields[0].keys() == fields[1].keys() and fields[0]
    for k, v in fields[0].items():
        assert torch.allclose(fields[1][k], v, rtol=1e-4, atol=1e-6), (k, (fields[1][k] - v).abs().max())
    for n in final:
        rays = {}
        for f in (runs / n).glob("metrics*.jsonl"):
            for r in map(json.loads, f.read_text().splitlines()):
                if "rays" in r:
                    rays[r["step"]] = rays.get(r["step"], 0) + r["rays"]
        assert rays == {s: 1536 for s in range(1, 61)}, (n, rays)
    assert sorted(losses(runs / "moved")) == list(range(1, 61))
    ck = runs / "moved" / "checkpoints"
    files = {p: p.read_bytes() for p in (runs / "moved").rglob("*") if p.is_file()}
    r5 = _torchrun(5, scene_dir, runs, "moved", "--resume", check=False)
    assert r5.returncode != 0
    errors = [l for l in r5.stderr.splitlines() if l.startswith("error: ")]
    assert errors and all("global batch of 1536 rays (512 per rank x 3 ranks) does not divide among 5 ranks" in l
                          and l.endswith("divides 1536: 4 or 6") for l in errors), r5.stderr[-3000:]
    assert {p: p.read_bytes() for p in (runs / "moved").rglob("*") if p.is_file()} == files
    assert latest_checkpoint(ck).name == "step_0000060"


@pytest.mark.slow  # two 1-rank SS runs in this process and one 2-rank torchrun launch: ~1 min
def test_ss_cells_move_to_other_ranks_on_resume(tmp_path):
    """An SS run of 4 cells on 1 rank, stopped at step 10 and resumed on 2 ranks (cells 0, 2 and
    1, 3: assign_rank), ends with each cell's field equal to the uninterrupted 1-rank run's up to
    floating-point order (each cell's stream and jitter are its own) and the fused PSNR within
    0.05 dB; 5 ranks for 4 cells are refused."""
    from dali_nerf.trainers.spatial import main as ss_main

    city = make_scene("city", tmp_path / "city", width=32, height=24, n_train=12, n_val=1, seed=1)
    common = ["--config", "configs/ss_city.yaml", f"scene.path={city}", f"train.runs_dir={tmp_path / 'runs'}",
              "train.steps=20", "train.checkpoint_every=10", "train.log_every=10", "train.eval_images=1", "train.lr=0.02",
              "pipeline.rays_per_batch=256", "pipeline.rays_per_run=1024", "partition.grid=[2,2]", "train.device=cpu",
              *TINY]
    assert ss_main([*common, "name=whole"]) == 0
    assert ss_main([*common, "name=moved", "train.stop_after=10"]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dali_nerf.trainers.spatial", *common, "name=moved", "--resume"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    runs = tmp_path / "runs"
    whole, moved = (json.loads((runs / n / "summary.json").read_text()) for n in ("whole", "moved"))
    assert moved["world_size"] == 2 and moved["resumed_from"] == 10 and whole["world_size"] == 1
    a, b = (latest_checkpoint(runs / n / "checkpoints") for n in ("whole", "moved"))
    assert sorted(p.name for p in b.iterdir()) == ["cell0.pt", "cell1.pt", "cell2.pt", "cell3.pt", RUN_FILE]
    for c in range(4):
        fa, fb = (load_file(f, f"cell{c}.pt")["task"]["field"] for f in (a, b))
        for k in fa:
            assert torch.allclose(fa[k], fb[k], rtol=1e-3, atol=1e-5), (c, k, float((fa[k] - fb[k]).abs().max()))
    print(f"fused PSNR: 1 rank {whole['fused_psnr']!r} dB, 1 -> 2 ranks {moved['fused_psnr']!r} dB")
    assert abs(whole["fused_psnr"] - moved["fused_psnr"]) < 0.05
    with pytest.raises(DaliNerfError, match="the run's 4 cells cannot be shared among 5 ranks"):
        load_checkpoint(b, 0, 5)


ELASTIC_RANK = r"""
import sys, datetime, torch, torch.distributed as dist
from pathlib import Path
from dali_nerf.train.resume import read_resume_state
from dali_nerf.train.runtime import DistEnv
rank, store, run = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
resume, st, folder = read_resume_state(run, DistEnv(rank, 2, rank, torch.device("cpu")), False)
print(f"resumed {st['step']}" if resume else "fresh", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


_GROUPS = itertools.count()


def _elastic_group(tmp_path, run: Path, counts, run_id: str = "t") -> list:
    """Two gloo ranks started as torchrun starts them (TORCHELASTIC_RUN_ID=run_id), rank r seeing
    TORCHELASTIC_RESTART_COUNT=counts[r], each running read_resume_state without --resume."""
    # a new store file for every group: a FileStore file another group used may still hold its keys
    # (the file is removed only when its last user has closed it), and a group meeting there hangs
    store = tmp_path / f"store{counts}{run_id}-{next(_GROUPS)}"
    procs = []
    for r in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID=run_id,
                   TORCHELASTIC_RESTART_COUNT=str(counts[r]))
        procs.append(subprocess.Popen([sys.executable, "-c", ELASTIC_RANK, str(r), str(store), str(run)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, o[0].strip(), o[1]) for p, o in zip(procs, outs)]


def test_torchrun_ranks_with_different_restart_counts_all_resume(tmp_path):
    """A job's group restarted because a node joined (the agent does not count it: restart count 0
    on every rank) or with a replacement node (0 there, 1 on the survivors) resumes on every rank
    alike when the run folder has a committed checkpoint of this job (its rdzv id recorded by its
    first group; rank 0 decides; no hang: a 30 s gloo timeout and a 90 s limit); it starts fresh
    when there is none; another job (a new launch, another rdzv id) starts anew on every rank with
    a note, and its own restarts then resume."""
    run = tmp_path / "run"
    ck = run / "checkpoints"
    assert [o[:2] for o in _elastic_group(tmp_path, run, (0, 0))] == [(0, "fresh")] * 2
    assert (ck / RUN_ID_FILE).read_text() == "t\n"
    save_file(ck, 4, MODEL_FILE, {"tasks": {}})
    save_file(ck, 4, RUN_FILE, {"format": 2, "step": 4, "world_size": 2, "method": "ddp", "cells": 0,
                                "ranks": [{"rng": {}, "sources": {}}] * 2})
    commit_checkpoint(ck, 4)
    for counts in ((0, 0), (0, 1)):
        got = _elastic_group(tmp_path, run, counts)
        assert [o[:2] for o in got] == [(0, "resumed 4")] * 2, got
        assert f"note: {ck} has checkpoints of this torchrun job (rdzv id t)" in got[0][2]
        assert "note" not in got[1][2]
    got = _elastic_group(tmp_path, run, (0, 0), run_id="u")
    assert [o[:2] for o in got] == [(0, "fresh")] * 2, got
    assert f"note: {ck} has checkpoints of another torchrun job (rdzv id t, this one u)" in got[0][2]
    assert (ck / RUN_ID_FILE).read_text() == "u\n"
    got = _elastic_group(tmp_path, run, (1, 0), run_id="u")
    assert [o[:2] for o in got] == [(0, "resumed 4")] * 2, got


def test_a_changed_seed_or_mode_is_refused_before_any_setup(scene_dir, tmp_path, capsys):
    """A resume with another pipeline.seed or pipeline.mode than run.pt's is refused in the resume
    check (exit 2, one line naming the folder, the key, both values and the fix), before any rank
    builds its loader; nothing in the run folder changes."""
    cfg = config(tmp_path, scene_dir)
    assert ddp(cfg, "train.steps=4") == 0
    run = tmp_path / "runs" / "run"
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    folder = latest_checkpoint(run / "checkpoints")
    for arg, key, saved, now in (("pipeline.seed=1", "seed", 0, 1), ("pipeline.mode=epoch", "mode", "random", "epoch")):
        capsys.readouterr()
        assert ddp(cfg, "--resume", arg) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: {folder}: written with pipeline.{key}={saved}, this run has {now}; resume with "
                       f"pipeline.{key}={saved}"), err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_the_refusal_names_the_rank_counts_nearest_W():
    """The valid rank counts named when W' does not divide G are the nearest below and above W'."""
    assert nearest_divisors(49152, 40) == [32, 48] and nearest_divisors(1536, 5) == [4, 6]
    assert nearest_divisors(256, 3) == [2, 4] and nearest_divisors(12, 13) == [12] and nearest_divisors(7, 7) == [7]
    assert nearest_divisors(7, 5) == [1, 7] and nearest_divisors(2 ** 20 * 3, 1000) == [768, 1024]
