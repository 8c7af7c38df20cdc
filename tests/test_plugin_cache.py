"""The plugin cache's key and pruning: a build key per DALI CUDA flavour (a cuda120 and a cuda130
DALI of one version never share a library), stale key folders removed, never the one in use nor
one whose lock another process holds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dali_nerf.ops as ops

DAY = 86400.0


def test_build_key_changes_with_the_dali_cuda_flavour(monkeypatch):
    import nvidia.dali as dali

    flavour = ops._dali_flavour()
    assert f"cuda{dali.__cuda_version__}" in flavour and "nvidia-dali" in flavour, flavour
    variants = [False] + ([True] if ops._find_nvcc() else [])

    def key(f, cuda):
        monkeypatch.setattr(ops, "_dali_flavour", lambda: f)
        plan = ops._build_plan(cuda)
        assert plan["ident"]["dali_flavour"] == f
        return plan["key"]

    for cuda in variants:
        k120 = key("nvidia-dali-cuda120 cuda12986", cuda)
        assert key("nvidia-dali-cuda130 cuda13000", cuda) != k120  # same DALI version, other CUDA flavour
        assert key("nvidia-dali-cuda120 cuda12986", cuda) == k120


def _folder(root: Path, name: str, age_days: float, stamp: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / ops.LIB_NAME).write_bytes(b"x")
    (d / "manifest.json").write_text("{}")
    t = time.time() - age_days * DAY
    paths = [d / ops.LIB_NAME, d / "manifest.json"]
    if stamp:
        (d / "last_used").write_text("")
        paths.append(d / "last_used")
    for p in paths + [d]:
        os.utime(p, (t, t))
    return d


HOLD = r"""
import sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1]); lock.acquire(); print("held", flush=True); time.sleep(60)
"""


def test_prune_removes_stale_folders_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DALI_NERF_CACHE", str(tmp_path))
    monkeypatch.delenv("DALI_NERF_CACHE_MAX_AGE_DAYS", raising=False)
    old = _folder(tmp_path, "cpu-old", 30)
    legacy = _folder(tmp_path, "cuda-legacy", 30, stamp=False)  # from before the stamp: its manifest's age
    recent = _folder(tmp_path, "cpu-recent", 2)
    in_use = _folder(tmp_path, "cuda-inuse", 30)
    locked = _folder(tmp_path, "cuda-locked", 30)
    foreign = _folder(tmp_path, "notes", 30)
    (tmp_path / ".trash-cpu-x-1").mkdir()  # a prune that crashed half-way
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(locked / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = ops.prune_cache(keep={"cuda-inuse"})
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == ["cpu-old", "cuda-legacy"]
    assert not old.exists() and not legacy.exists() and not (tmp_path / ".trash-cpu-x-1").exists()
    for d in (recent, in_use, locked, foreign):
        assert (d / ops.LIB_NAME).is_file(), d  # recent, the one in use, the one being built, not ours
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trash-")]
    # the age is configurable; < 0 disables pruning
    monkeypatch.setenv("DALI_NERF_CACHE_MAX_AGE_DAYS", "-1")
    assert ops.prune_cache() == [] and recent.exists()
    assert ops.prune_cache(max_age_days=1) == ["cpu-recent", "cuda-inuse", "cuda-locked"]


def test_build_plugin_stamps_its_folder_and_prunes_the_stale_ones(tmp_path, monkeypatch):
    lib = ops.build_plugin(cuda=False)  # the user's cache (built once; reused by the rest of the suite)
    cache = tmp_path / "cache"
    shutil.copytree(lib.parent, cache / lib.parent.name, ignore=shutil.ignore_patterns(".lock"))
    stale = _folder(cache, "cpu-0123456789abcdef0000", 30)
    monkeypatch.setenv("DALI_NERF_CACHE", str(cache))
    monkeypatch.delenv("DALI_NERF_CACHE_MAX_AGE_DAYS", raising=False)
    t0 = time.time()
    got = ops.build_plugin(cuda=False)
    assert got == cache / lib.parent.name / ops.LIB_NAME
    builds = (got.parent / "builds.log").read_text().splitlines()
    assert builds == (lib.parent / "builds.log").read_text().splitlines()  # reused, not compiled again
    assert (got.parent / "last_used").stat().st_mtime >= t0 - 1
    assert not stale.exists()
