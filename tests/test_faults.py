"""Faults survived (docs/RELIABILITY.md): a rank SIGKILLed mid-run under torchrun --max-restarts,
a kill during a checkpoint write, shutdown of every loader on close and exception (Ctrl-C: tests/test_interrupt.py), the
plugin cache keyed by its sources, and untrusted files that never run code.

Kills come from the outside (the test finds the rank-1 worker under torchrun and SIGKILLs it),
not from a hook inside the trainer. Processes are inspected through /proc (psutil is not a
dependency).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dali_nerf.train.checkpoint import commit_checkpoint, latest_checkpoint, load_rank_state, save_rank_state
from dali_nerf.errors import DaliNerfError, SceneError
from dali_nerf.train.resume import load_checkpoint
from dali_nerf.scenegen import make_scene
from dali_nerf.scenes import load_scene

W = H = 24


# ------------------------------------------------------------------------------- /proc helpers

def _ppid(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]  # (ppid, state)


def children(pid: int) -> list:
    """Live (non-zombie) direct children of ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            r = _ppid(int(d))
            if r is not None and r[0] == pid and r[1] != "Z":
                out.append(int(d))
    return out


def descendants(pid: int) -> list:
    todo, out = [pid], []
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    r = _ppid(pid)
    return r is not None and r[1] != "Z"


def environ(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def kill_all(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# ------------------------------------------------------------------------------- shared tiny setup

@pytest.fixture(scope="module")
def scene_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return Path(make_scene("objects", root / "scene", width=W, height=H, n_train=8, n_val=1, n_test=2))


def tiny_config(tmp_path, scene, name="run", runs=None, extra="") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"name: {name}\nmethod: ddp\nscene:\n  path: {scene}\n"
        f"pipeline:\n  rays_per_batch: 256\n  rays_per_run: 1024\n"
        f"model:\n  resolution: 16\n  samples_per_ray: 16\n  occupancy_resolution: 0\n"
        f"train:\n  steps: 12\n  checkpoint_every: 4\n  log_every: 1\n  eval_images: 1\n  device: cpu\n"
        f"  runs_dir: {runs or tmp_path / 'runs'}\n" + extra)
    return p


def _env():
    env = dict(os.environ)
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env["OMP_NUM_THREADS"] = "1"
    # torch 2.x shares the rendezvous TCPStore with the workers' process group by default; its keys
    # are not isolated per restart, so a restarted gloo group may read the dead rank's stale
    # address (connection refused / hang; pytorch/pytorch#135712). A fresh store per restart:
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


# ------------------------------------------------------------------------------- rank killed under torchrun

def _torchrun(cfg: Path, *extra) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra,
            "-m", "dali_nerf.trainers.ddp", "--config", str(cfg)]


def _final_state(run: Path) -> dict:
    folder = latest_checkpoint(run / "checkpoints")
    assert folder is not None and folder.name == "step_0000012"
    return {r: load_checkpoint(folder, r) for r in (0, 1)}


@pytest.mark.slow
def test_rank_sigkill_restarts_from_checkpoint_and_matches_uninterrupted(scene_dir, tmp_path):
    kill_after = random.randint(5, 7)  # a step after the first checkpoint (4) and before the last
    cfg = tiny_config(tmp_path, scene_dir, "faulted", tmp_path / "a")
    run = tmp_path / "a" / "faulted"
    proc = subprocess.Popen(_torchrun(cfg, "--max-restarts=1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), start_new_session=True)
    victim = None
    try:
        deadline = time.time() + 240
        metrics1 = run / "metrics.rank1.jsonl"
        while victim is None and time.time() < deadline and proc.poll() is None:
            if metrics1.is_file():
                steps = [json.loads(l)["step"] for l in metrics1.read_text().splitlines() if l.strip().endswith("}")]
                if steps and max(steps) >= kill_after:
                    rank1 = [p for p in children(proc.pid) if environ(p).get("RANK") == "1"]
                    assert len(rank1) == 1, rank1
                    victim = rank1[0]
                    killed_at = max(steps)
                    os.kill(victim, signal.SIGKILL)
                    break
            time.sleep(0.01)
        assert victim is not None, "rank 1 never reached the kill step"
        out, err = proc.communicate(timeout=300)
    finally:
        # the whole session: torchrun and any worker it left behind when it failed
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert not alive(victim)
    summary = json.loads((run / "summary.json").read_text())
    # resumed from the newest checkpoint committed before the kill
    assert summary["resumed_from"] in (4, 8) and summary["resumed_from"] <= killed_at, (summary["resumed_from"], killed_at)
    assert summary["steps_this_run"] == 12 - summary["resumed_from"]

    # the uninterrupted reference run
    ref_cfg = tiny_config(tmp_path, scene_dir, "faulted", tmp_path / "b")
    r = subprocess.run(_torchrun(ref_cfg), capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = tmp_path / "b" / "faulted"

    got, want = _final_state(run), _final_state(ref)
    for rank in (0, 1):
        gf, wf = got[rank]["tasks"]["ddp"]["field"], want[rank]["tasks"]["ddp"]["field"]
        assert gf.keys() == wf.keys()
        for k in wf:
            assert torch.equal(gf[k], wf[k]), (rank, k)
        # the loader's stream state (position, epoch, seed, ...) is the same; "steps" counts the
        # steps this process served (a statistic), which restarts with the process
        gs, ws = (dict(x[rank]["tasks"]["ddp"]["source"]) for x in (got, want))
        gs.pop("steps", None), ws.pop("steps", None)
        # the global stream (the trainers' default): position 12 global batches of 2 x 256 rays
        assert gs == ws and gs["position"] == 12 * 2 * 256 and gs["step"] == 12, (gs, ws)
        go, wo = got[rank]["tasks"]["ddp"]["optimizer"]["state"], want[rank]["tasks"]["ddp"]["optimizer"]["state"]
        for k in wo:
            for kk in wo[k]:
                assert torch.equal(torch.as_tensor(go[k][kk]), torch.as_tensor(wo[k][kk])), (rank, k, kk)
    # the per-step losses agree too (rank 0's metrics: kept lines up to the checkpoint + the rerun)
    la = [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l)["loss"] for l in (ref / "metrics.jsonl").read_text().splitlines()]
    assert la == lb and len(la) == 12


# ------------------------------------------------------------------------------- kill during a checkpoint write

SLOW_SAVE_CHILD = r"""
import sys, torch
from dali_nerf.train.checkpoint import save_rank_state
big = torch.zeros(192 << 20, dtype=torch.uint8)   # 192 MiB: the write takes a while
save_rank_state(sys.argv[1], 8, 1, {"step": 8, "tasks": {"ddp": {"field": {"w": big}}}})
print("finished", flush=True)
"""


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    root = tmp_path / "checkpoints"
    prev = {r: {"step": 4, "rank": r, "tasks": {"ddp": {"field": {"w": torch.full((100,), float(r))}}}} for r in (0, 1)}
    for r in (0, 1):
        save_rank_state(root, 4, r, prev[r])
    commit_checkpoint(root, 4)
    save_rank_state(root, 8, 0, {"step": 8})  # rank 0 finished its step-8 file; rank 1 is killed mid-write
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE_CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    step8 = root / "step_0000008"
    seen = 0
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            tmps = list(step8.glob(".rank1.pt.tmp-*"))
            if tmps:
                try:
                    seen = tmps[0].stat().st_size
                except FileNotFoundError:
                    seen = 0
                if seen > 0:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert seen > 0 and "finished" not in out, "the child finished before it could be killed mid-write"
    assert proc.returncode == -signal.SIGKILL
    assert not (step8 / "rank1.pt").exists()  # never visible under its final name
    partial = list(step8.glob(".rank1.pt.tmp-*"))
    assert len(partial) == 1 and partial[0].stat().st_size < (192 << 20)  # really killed mid-write
    folder = latest_checkpoint(root)
    assert folder is not None and folder.name == "step_0000004"
    for r in (0, 1):
        st = load_rank_state(folder, r)
        assert st["step"] == 4 and torch.equal(st["tasks"]["ddp"]["field"]["w"], prev[r]["tasks"]["ddp"]["field"]["w"])
    # the half-written step is not loadable by mistake: its rank-1 file does not exist
    with pytest.raises(DaliNerfError, match="checkpoint file missing"):
        load_rank_state(step8, 1)


# ------------------------------------------------------------------------------- loaders leave nothing behind

def _threads():
    return {t.ident for t in threading.enumerate()}


def _wait_threads(before: set, native_before: int, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _threads() <= before and native_threads() <= native_before:
            return
        time.sleep(0.05)
    extra = [t.name for t in threading.enumerate() if t.ident not in before]
    raise AssertionError(f"left behind: python threads {extra}, native {native_threads()} > {native_before}")


def test_rayloader_close_and_exception_leave_no_threads(scene_dir):
    from dali_nerf.sources import RayLoader

    scene = load_scene(scene_dir, "train")
    with RayLoader(scene, rays_per_batch=64, rays_per_run=256, prefetch=2) as warm:  # plugin load, DALI init
        next(iter(warm))
    before, native = _threads(), native_threads()
    loader = RayLoader(scene, rays_per_batch=64, rays_per_run=256, prefetch=2)
    it = iter(loader)
    for _ in range(5):
        next(it)
    assert native_threads() > native  # the DALI pipeline's worker threads exist while it runs
    loader.close()
    _wait_threads(before, native)
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    with pytest.raises(ZeroDivisionError):
        with RayLoader(scene, rays_per_batch=64, rays_per_run=256, prefetch=2) as l2:
            next(iter(l2))
            1 / 0
    _wait_threads(before, native)


def test_spatial_loader_close_leaves_no_threads(tmp_path):
    from dali_nerf.config import PartitionConfig
    from dali_nerf.partition import Partition
    from dali_nerf.sources import SpatialRayLoader

    scene = load_scene(make_scene("city", tmp_path / "city", width=16, height=12, n_train=8, n_val=1), "train",
                       format="mega_nerf")
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)
    before, native = _threads(), native_threads()
    loader = SpatialRayLoader(scene, part, 0, rays_per_batch=64, rays_per_run=256, prefetch=2)
    for _, b in zip(range(4), loader):
        assert b["origins"].shape == (64, 3)
    assert native_threads() > native  # DALI's worker threads compute runs ahead
    loader.close()
    _wait_threads(before, native)
    with pytest.raises(KeyError):
        with SpatialRayLoader(scene, part, 1, rays_per_batch=64, rays_per_run=256, prefetch=2) as l2:
            next(iter(l2))
            raise KeyError("boom")
    _wait_threads(before, native)


def test_torch_workers_close_leaves_no_processes(scene_dir):
    from dali_nerf.sources import TorchWorkersSampler

    scene = load_scene(scene_dir, "train")
    me = os.getpid()
    before = set(children(me))
    s = TorchWorkersSampler(scene, rays_per_batch=64, workers=2, prefetch=1)
    it = iter(s)
    for _ in range(3):
        next(it)
    workers = set(children(me)) - before
    assert len(workers) == 2
    s.close()
    deadline = time.time() + 20
    while time.time() < deadline and any(alive(p) for p in workers):
        time.sleep(0.05)
    assert not any(alive(p) for p in workers)


def test_exception_in_training_loop_closes_sources(scene_dir, tmp_path, monkeypatch):
    """An error inside the loop (here: the renderer raising at step 3) propagates, and the loop's
    ``finally`` has closed the batch source: no DALI threads, no torch worker processes."""
    import dali_nerf.train.loop as training
    from dali_nerf.config import load_config
    from dali_nerf.train.loop import train
    from dali_nerf.trainers.ddp import DDPMethod

    real = training.render_rays
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise FloatingPointError("injected failure at step 3")
        return real(*a, **k)

    monkeypatch.setattr(training, "render_rays", failing)  # the name the loop calls
    for name in ("rays", "torch_workers"):
        calls["n"] = 0
        cfg = load_config(tiny_config(tmp_path, scene_dir, f"exc_{name}", extra=f"  torch_threads: 1\n"),
                          [f"pipeline.name={name}", "pipeline.workers=2", "pipeline.rays_per_batch=64"])
        me = os.getpid()
        kids, before, native = set(children(me)), _threads(), native_threads()
        with pytest.raises(FloatingPointError):
            train(cfg, DDPMethod())
        assert calls["n"] == 3
        _wait_threads(before, native + 1)  # +1: torch may keep one lazily created intra-op thread
        deadline = time.time() + 20
        while time.time() < deadline and set(children(me)) - kids:
            time.sleep(0.05)
        assert not set(children(me)) - kids, name
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(l)["step"] for l in lines] == [1, 2]  # steps before the failure were kept


# ------------------------------------------------------------------------------- plugin cache

def test_plugin_cache_key_follows_sources(tmp_path, monkeypatch):
    """A cached library built from other sources (stale) is never reused: the build key hashes the
    sources; a manifest for another key, or a library whose sha256 differs, is not a cache hit.
    (Concurrent ranks building once and corrupt libraries being rebuilt by real compiles are in
    tests/test_plugin_build.py::test_concurrent_build_once_then_corruption_rebuilt.)"""
    import dali_nerf.ops as ops

    key0 = ops._build_plan(False)["key"]
    src = tmp_path / "csrc"
    shutil.copytree(ops._CSRC, src)
    monkeypatch.setattr(ops, "_CSRC", src)
    assert ops._build_plan(False)["key"] == key0  # same bytes, same key
    (src / "ray_sampler.cc").write_text((src / "ray_sampler.cc").read_text() + "\n// edited\n")
    key1 = ops._build_plan(False)["key"]
    assert key1 != key0
    lib, manifest = tmp_path / ops.LIB_NAME, tmp_path / "manifest.json"
    lib.write_bytes(b"\x7fELF pretend library")
    manifest.write_text(json.dumps({"key": key0, "sha256": ops._sha256(lib)}))
    assert not ops._cached_ok(lib, manifest, key1)  # stale: built for other sources
    assert ops._cached_ok(lib, manifest, key0)
    lib.write_bytes(b"\x7fELF pretend library, corrupted")
    assert not ops._cached_ok(lib, manifest, key0)  # corrupt: sha256 mismatch
    manifest.write_text("{not json")
    assert not ops._cached_ok(lib, manifest, key0)


# ------------------------------------------------------------------------------- untrusted files never run code

class _Evil:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted(path: Path, marker: Path, wrap=None) -> Path:
    torch.save(wrap(_Evil(marker)) if wrap else _Evil(marker), path)
    return path


def test_crafted_pickle_is_really_dangerous(tmp_path):
    """Control: the crafted file does run code under a plain torch.load (weights_only=False)."""
    proof = tmp_path / "proof"
    _crafted(tmp_path / "x.pt", proof)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert proof.exists()


def test_crafted_mega_nerf_metadata_refused(tmp_path):
    root = Path(make_scene("city", tmp_path / "city", width=16, height=12, n_train=4, n_val=1))
    marker = tmp_path / "PWNED"
    meta = sorted((root / "train" / "metadata").glob("*.pt"))[1]
    _crafted(meta, marker, wrap=lambda e: {"W": 16, "H": 12, "c2w": e})
    with pytest.raises(SceneError) as e:
        load_scene(root, "train", format="mega_nerf")
    msg = str(e.value)
    assert "\n" not in msg and meta.name in msg and "refusing to unpickle" in msg
    assert not marker.exists()
    shutil.copy(sorted((root / "train" / "metadata").glob("*.pt"))[0], meta)
    load_scene(root, "train", format="mega_nerf")  # restored: loads again
    _crafted(root / "coordinates.pt", marker)
    with pytest.raises(SceneError, match="coordinates.pt.*refusing to unpickle"):
        load_scene(root, "train", format="mega_nerf")
    assert not marker.exists()


def test_crafted_checkpoint_refused_by_resume_and_render(scene_dir, tmp_path, capsys):
    """A run folder whose latest checkpoint is a crafted pickle: ``--resume`` and ``dali-nerf
    render --checkpoint`` refuse it in one line (exit 2) and the code never runs."""
    from dali_nerf.cli.main import main as cli_main
    from dali_nerf.config import config_to_dict, load_config
    from dali_nerf.trainers.ddp import main as ddp_main
    import yaml

    cfg_path = tiny_config(tmp_path, scene_dir, "victim")
    cfg = load_config(cfg_path)
    run = cfg.run_dir
    marker = tmp_path / "PWNED"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    save_rank_state(run / "checkpoints", 4, 0, {"placeholder": 1})
    commit_checkpoint(run / "checkpoints", 4)
    bad = run / "checkpoints" / "step_0000004" / "rank0.pt"
    _crafted(bad, marker, wrap=lambda e: {"step": 4, "rank": 0, "world_size": 1, "tasks": e})

    capsys.readouterr()
    rc = ddp_main(["--config", str(cfg_path), "--resume"])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "rank0.pt" in lines[0] and "refusing to unpickle" in lines[0] and "only load checkpoints written by dali_nerf" in lines[0]
    assert not marker.exists()

    rc = cli_main(["render", "--checkpoint", str(run), "--out", str(tmp_path / "renders")])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and "rank0.pt" in lines[0] and "refusing to unpickle" in lines[0], err
    assert not marker.exists()
    assert not (run / "metrics.jsonl").exists()  # the refused resume wrote nothing


# ------------------------------------------------------------------------------- damaged newest checkpoint

def _flip_a_data_byte(path: Path) -> None:
    """Flip one byte in the middle of the largest record of a torch zip file (its tensor data):
    torch.load alone would read it without noticing."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_damaged_newest_checkpoint_falls_back_then_none_left(scene_dir, tmp_path, capsys):
    """A truncated newest rank file: --resume warns naming it and resumes every rank from the
    previous complete checkpoint, and the steps it retrains have the losses of the first run.
    With no complete checkpoint left (a flipped bit inside the newest one's tensor data, found by
    its CRC; an empty older file): one line naming both files, exit 2, nothing written."""
    from dali_nerf.trainers.ddp import main as ddp_main

    cfg = tiny_config(tmp_path, scene_dir, extra="")
    assert ddp_main(["--config", str(cfg), "train.steps=8"]) == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "run"
    ck = run / "checkpoints"
    first = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    newest = ck / "step_0000008" / "model.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    capsys.readouterr()
    assert ddp_main(["--config", str(cfg), "--resume", "train.steps=8"]) == 0
    err = capsys.readouterr().err
    warns = [l for l in err.splitlines() if l.startswith("warning:")]
    assert len(warns) == 1 and str(newest) in warns[0] and "not a readable dali_nerf checkpoint" in warns[0], err
    assert f"previous complete checkpoint {ck / 'step_0000004'} (step 4)" in warns[0] and "Traceback" not in err
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 4
    again = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert again == first  # steps 5..8 retrained from step 4 exactly as the first time
    assert load_checkpoint(ck / "step_0000008", 0)["step"] == 8  # rewritten whole

    _flip_a_data_byte(newest)
    torch.load(newest, weights_only=True)  # torch alone does not notice
    (ck / "step_0000004" / "model.pt").write_bytes(b"")
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert ddp_main(["--config", str(cfg), "--resume", "train.steps=12"]) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in (str(ck), "no complete checkpoint to resume from", f"{newest}: corrupt checkpoint (checksum mismatch",
              f"{ck / 'step_0000004' / 'model.pt'}: not a readable dali_nerf checkpoint", "without --resume"):
        assert w in lines[0], (w, lines[0])
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def _two_ranks(fn):
    """Run ``fn(rank, gather)`` on two threads standing in for two ranks; ``gather`` is an
    all-gather of one int per rank (a barrier), like the trainer's all-reduce. Returns
    {rank: result or exception}."""
    box, out = [None, None], {}
    barrier = threading.Barrier(2)

    def gather(rank, code):
        box[rank] = code
        barrier.wait()
        got = list(box)
        barrier.wait()
        return got

    def run(rank):
        try:
            out[rank] = fn(rank, lambda code: gather(rank, code))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[rank] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_ranks_agree_on_the_step_they_resume_from(tmp_path):
    """Only rank 1's newest file is damaged: both ranks resume from the previous step (never rank
    0 from step 8 and rank 1 from step 4); only rank 1 reports a skipped file. A rank that refuses
    (another world size) stops every rank."""
    from dali_nerf.train.checkpoint import resume_checkpoint

    root = tmp_path / "checkpoints"
    for step in (4, 8):
        for r in (0, 1):
            save_rank_state(root, step, r, {"step": step, "rank": r})
        commit_checkpoint(root, step)
    (root / "step_0000008" / "rank1.pt").write_bytes(b"PK\x03\x04 cut short")
    got = _two_ranks(lambda rank, gather: resume_checkpoint(root, rank, gather=gather))
    assert [got[r][0].name for r in (0, 1)] == ["step_0000004"] * 2, got
    assert [got[r][1]["step"] for r in (0, 1)] == [4, 4] and got[0][2] == []
    assert [e.path.name for e in got[1][2]] == ["rank1.pt"] and got[1][2][0].path.parent.name == "step_0000008"

    (root / "step_0000004" / "rank0.pt").write_bytes(b"")
    got = _two_ranks(lambda rank, gather: resume_checkpoint(root, rank, gather=gather))
    for r in (0, 1):
        assert isinstance(got[r], DaliNerfError) and "no complete checkpoint" in str(got[r]), got
        assert "step_0000008/rank1.pt" in str(got[r]) and "step_0000004/rank0.pt" in str(got[r]), got

    def check(rank):
        def fn(st, folder):
            if rank == 1:
                raise DaliNerfError(f"{folder}: saved with world size 2, now 3")
        return fn

    save_rank_state(root, 4, 0, {"step": 4, "rank": 0})
    got = _two_ranks(lambda rank, gather: resume_checkpoint(root, rank, check(rank), gather=gather))
    assert "world size" in str(got[1]) and "rank 1 refused" in str(got[0]), got


RESUME_RANK = r"""
import sys, torch, torch.distributed as dist
from pathlib import Path
from dali_nerf.train.resume import read_resume_state
from dali_nerf.train.runtime import DistEnv
rank, store, run = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
resume, st, folder = read_resume_state(run, DistEnv(rank, 2, rank, torch.device("cpu")), True)
print("resumed", folder.name, st["step"], flush=True)
dist.destroy_process_group()
"""


def test_two_real_ranks_agree_through_gloo(tmp_path):
    """The trainer's own read_resume_state on two processes with a real gloo group: rank 1's
    newest file is truncated, so both resume from step 4 and only rank 1 warns."""
    ck = tmp_path / "run" / "checkpoints"
    for step in (4, 8):
        for r in (0, 1):
            save_rank_state(ck, step, r, {"step": step, "rank": r, "world_size": 2, "tasks": {}, "rng": {}})
        commit_checkpoint(ck, step)
    bad = ck / "step_0000008" / "rank1.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RESUME_RANK, str(r), str(tmp_path / "store"), str(tmp_path / "run")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["resumed step_0000004 4"] * 2, outs
    assert "warning" not in outs[0][1]
    assert f"warning: {bad}: not a readable dali_nerf checkpoint" in outs[1][1], outs[1][1]
