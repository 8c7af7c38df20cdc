"""Emulated devices and the study's trial machinery: phase attribution (a slow source shows up as
wait, a slow device as its own phase), the shared-memory scatter, the host budget, the rotated
schedule, the SS torch_workers source, intervals and pairs from hand-written trials, and the
clean-commit check."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dali_nerf.bench import emulated as em
from dali_nerf.bench import study
from dali_nerf.train.emulation import EmulatedDevice, LockstepBarrier, PhaseTimer, emulated_step
from dali_nerf.sources import ReadySource as ReadyBatch
from dali_nerf.sources.shm_scatter import ShmScatter
from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import host_budget

PH = ("wait", "h2d", "forward", "backward", "sync", "optimizer")


def _batch(n=64, fill=0.0):
    f = torch.full((n, 3), fill)
    return {"origins": f.clone(), "directions": f.clone(), "rgb": f.clone(), "indices": torch.zeros((n, 3), dtype=torch.int64),
            "near": torch.zeros((n, 1)), "far": torch.ones((n, 1))}


class FakeClock:
    """``time`` for the modules under test: ``perf_counter`` reads a counter that only ``sleep``
    advances, by exactly what was asked, so the phases come out exact whatever the host's load
    (the real waits are the emulated launches', measured by the study)."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.now += s

    def __getattr__(self, name):  # process_time and the rest: the real ones
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch):
    from dali_nerf.train import emulation, phases

    c = FakeClock()
    monkeypatch.setattr(emulation, "time", c)
    monkeypatch.setattr(phases, "time", c)
    return c


class _SleepySource:
    """Hands out a ready batch after sleeping ``s`` seconds (a slow sampler) on ``clock``."""

    def __init__(self, s, clock):
        self.s, self.b, self.clock = s, _batch(), clock

    def __next__(self):
        self.clock.sleep(self.s)
        return self.b


def _run(src, dev, steps=12):
    """Per phase: (min, median) seconds over the steps."""
    t = PhaseTimer()
    recs = []
    for k in range(steps):
        emulated_step(src, dev, t)
        recs.append(t.record(k + 1, 64))
    out = {p: (float(np.min([r[f"{p}_s"] for r in recs])), float(np.median([r[f"{p}_s"] for r in recs])))
           for p in PH + ("step",)}
    gaps = [r["step_s"] - sum(r[f"{p}_s"] for p in PH) for r in recs]
    out["gap"] = (float(np.min(gaps)), float(np.median(gaps)))
    return out


def test_slow_source_is_wait_and_compute_unchanged(clock):
    dev = EmulatedDevice(step_ms=5.0 * 4096 / 64)  # 5 ms for the 64-ray batch
    fast = _run(ReadyBatch(_batch()), dev)
    slow = _run(_SleepySource(0.020, clock), dev)
    exact = lambda v: pytest.approx(v, abs=1e-9)  # noqa: E731
    assert slow["wait"] == (exact(0.020), exact(0.020)) and fast["wait"] == (exact(0), exact(0))  # the 20 ms is wait
    # the device phase is the same with either source: compute unchanged
    assert fast["forward"] == slow["forward"] == (exact(0.005), exact(0.005))
    assert slow["h2d"] == fast["h2d"] == (exact(dev.links.h2d_s(4 * 11 * 64 + 8 * 3 * 64)),) * 2
    assert slow["gap"] == fast["gap"] == (exact(0), exact(0))  # the phases cover the step


def test_slow_device_is_its_own_phase_not_wait(clock):
    ms = _run(ReadyBatch(_batch()), EmulatedDevice(step_ms=20.0 * 4096 / 64))
    assert ms["forward"] == (pytest.approx(0.020, abs=1e-9),) * 2
    assert ms["wait"] == (0.0, 0.0) and ms["sync"] == (0.0, 0.0)
    # a lockstep that takes time shows up as sync
    t = PhaseTimer()
    emulated_step(ReadyBatch(_batch()), EmulatedDevice(0.0), t, lockstep=lambda: clock.sleep(0.015))
    rec = t.record(1, 64)
    assert rec["sync_s"] == pytest.approx(0.015, abs=1e-9) and rec["wait_s"] == 0.0
    with pytest.raises(ValueError, match="unknown phase"):
        with t.phase("nope"):
            pass


def test_device_times():
    dev = EmulatedDevice(step_ms=2.0)
    assert dev.compute_s(4096) == pytest.approx(0.002)
    assert dev.compute_s(8192) == pytest.approx(0.004)
    L = dev.links
    assert L.allreduce_s(1000, 1) == 0.0
    assert L.allreduce_s(360_000_000, 2) == pytest.approx(L.link_latency_s + 1e-3)
    assert L.h2d_s(50_000_000) == pytest.approx(L.h2d_latency_s + 1e-3)
    assert L.scatter_s(360_000, 4) == pytest.approx(L.link_latency_s + 1e-6)


def _lockstep_rank(bar, arrived, rank: int, rounds: int, errors) -> None:
    """Rank body of the LockstepBarrier test: after round k's wait every rank has arrived at round
    k (none is a round behind), and none is more than one round ahead."""
    W = bar.parties
    for k in range(1, rounds + 1):
        arrived[rank] = k
        bar.wait(30)
        seen = [arrived[r] for r in range(W)]
        if min(seen) < k or max(seen) > k + 1:
            errors.value += 1


def test_lockstep_barrier_keeps_ranks_in_rounds_across_processes():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    W, rounds = 4, 300
    bar = LockstepBarrier(ctx, W)
    arrived, errors = ctx.RawArray("i", W), ctx.RawValue("i", 0)
    ps = [ctx.Process(target=_lockstep_rank, args=(bar, arrived, r, rounds, errors)) for r in range(W)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    assert [p.exitcode for p in ps] == [0] * W
    assert errors.value == 0 and list(arrived) == [rounds] * W


def test_lockstep_barrier_timeout_and_abort_break_it():
    import multiprocessing as mp

    bar = LockstepBarrier(mp.get_context("spawn"), 2)
    t = time.perf_counter()
    with pytest.raises(threading.BrokenBarrierError):
        bar.wait(0.05)  # the other rank never comes
    assert time.perf_counter() - t < 5
    with pytest.raises(threading.BrokenBarrierError):
        bar.wait(5)  # broken for every later call, at once
    one = LockstepBarrier(mp.get_context("spawn"), 1)
    assert [one.wait(1) for _ in range(3)] == [0, 0, 0]  # a party of one never blocks


def test_shm_scatter_two_ranks_get_their_slices():
    W, B, steps = 2, 8, 5
    buf = bytearray(ShmScatter.buffer_bytes(W, B))
    bar = threading.Barrier(W)

    def sample(step):
        return [_batch(B, fill=100 * step + r) for r in range(W)]

    got = {r: [] for r in range(W)}

    def rank(r):
        src = ShmScatter(sample if r == 0 else None, buf, bar.wait, r, W, B, EmulatedDevice(0.0))
        for _ in range(steps):
            b = next(src)
            got[r].append((float(b["origins"][0, 0]), b["origins"].shape, float(b["far"][0, 0])))

    th = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in th:
        t.start()
    for t in th:
        t.join(10)
    for r in range(W):
        assert [g[0] for g in got[r]] == [100.0 * s + r for s in range(steps)]
        assert all(g[1] == (B, 3) and g[2] == 1.0 for g in got[r])
    with pytest.raises(ValueError, match="needs"):
        ShmScatter(None, bytearray(10), bar.wait, 1, W, B, EmulatedDevice(0.0))


def test_host_budget():
    b = host_budget(4096, local_ranks=16, cores=2)
    assert (b.threads, b.rays_per_run) == (1, 65536)
    assert host_budget(4096, local_ranks=1, cores=2).threads == 1
    assert host_budget(4096, local_ranks=8, cores=32).threads == 3
    big = host_budget(4096, local_ranks=1, cores=64)
    assert big.threads == 4 and big.rays_per_run == 262144
    assert host_budget(5000, local_ranks=1, cores=8).rays_per_run % 5000 == 0
    with pytest.raises(ConfigError, match="rays_per_batch"):
        host_budget(0)


def test_host_budget_reads_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_budget(4096, cores=16).local_ranks == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        host_budget(4096)


@pytest.mark.parametrize("baselines", [["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]])
def test_schedule_rotates_and_pairs_are_adjacent(baselines):
    samplers = baselines + ["rays"]
    segs = em.schedule(samplers, [("a", 1.0, 4096), ("b", 2.0, 4096)], 3)
    assert {(s.step_name, s.grid) for s in segs} == {("a", "main"), ("b", "main")}
    first, last = set(), set()
    for t in range(3):
        for ms in (1.0, 2.0):
            run = [s for s in segs if s.trial == t and s.step_ms == ms]
            assert sorted(s.sampler for s in run if s.sampler not in ("rays",)) == sorted(baselines + [em.FLOOR])
            names = [s.name for s in run]
            for i, s in enumerate(run):
                if s.sampler in baselines:  # its pair is right next to it
                    j = names.index(s.pair)
                    assert abs(i - j) == 1 and run[j].sampler == "rays"
            core = [s.sampler for s in run if s.sampler != em.FLOOR]
            first.add(core[0])
            last.add(core[-1])
    assert len(first) > 1 and len(last) > 1  # no sampler always first or last
    assert len({s.name for s in segs}) == len(segs)
    # the cost model's check segments (other batch sizes): every sampler once, beside their own floor
    chk = em.schedule(samplers, [("a", 2.0, 4096)], 1, check=[("check", 1.0, 2048)])
    extra = [s for s in chk if s.rays == 2048]
    assert {s.sampler for s in extra} == set(samplers) | {em.FLOOR}
    assert [s.sampler for s in extra].count(em.FLOOR) == 1
    assert all(s.trial == 1 and s.step_ms == 1.0 and s.grid == "check" and s.step_name == "check" for s in extra)
    assert all(s.grid == "main" for s in chk if s.rays == 4096)


def test_ss_grid():
    assert [em.ss_grid(w) for w in (1, 2, 4, 8, 16)] == [[1, 1], [2, 1], [2, 2], [4, 2], [4, 4]]


def test_mean_ci():
    m, (lo, hi) = study.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 * 1.0 / np.sqrt(3), rel=1e-3) and m - lo == pytest.approx(hi - m)
    assert study.mean_ci([5.0]) == (5.0, [5.0, 5.0])


def _seg(root: Path, name, method, sampler, ranks, trial, wait, rest, pair=None, ems=2.0, steps=4, cpu=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"name": name, "method": method,
                                                   "pipeline": {"name": sampler, "rays_per_batch": 512, "num_threads": 1},
                                                   "train": {"device": "emulated", "emulated_step_ms": ems},
                                                   "bench": {"warmup": 1}}))
    (d / "study.json").write_text(json.dumps({"trial": trial, "pair": pair, "device": "emulated", "emulated_step_ms": ems,
                                              "budget": {"cores": 2}}))
    for r in range(ranks):
        recs = []
        for s in range(1, steps + 1):
            ph = {"wait": wait, "h2d": 0.0, "forward": rest, "backward": 0.0, "sync": 0.0, "optimizer": 0.0}
            if s == 1:
                ph = {k: 1.0 for k in ph}
            recs.append(json.dumps({"step": s, "rays": 512, **{f"{k}_s": v for k, v in ph.items()},
                                    "step_s": sum(ph.values())} | ({"cpu_s": cpu} if cpu is not None else {})))
        (d / ("metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl")).write_text("\n".join(recs) + "\n")
    return d


def test_derive_trials_pairs_and_flags(tmp_path):
    dirs = []
    # three trials: baseline waits 5 ms of a 10 ms step; the floor (same step, no data cost) takes
    # 5 ms, so the data stall is 50% and the ideal 2x; the pipelined runs next to it take 5.0, 5.5,
    # 6.0 ms (speedups 2.0, 1.82, 1.67); a second pipelined run per trial, not adjacent, is 20 ms
    # and must not enter the pairs
    for t, p in enumerate((0.005, 0.0055, 0.006)):
        dirs.append(_seg(tmp_path, f"g{t}", "ddp", "sync_global", 2, t, 0.005, 0.005, pair=f"p{t}"))
        dirs.append(_seg(tmp_path, f"p{t}", "ddp", "rays", 2, t, 0.0, p))
        dirs.append(_seg(tmp_path, f"q{t}", "ddp", "rays", 2, t, 0.0, 0.0056))
        dirs.append(_seg(tmp_path, f"f{t}", "ddp", em.FLOOR, 2, t, 0.0, 0.005))
        # sync_local at 3 ms device steps: waits 1 ms of 5 ms, the floor's step: no data stall (ideal
        # 1x), yet its pair is 2 ms: speedup 2.5x, faster than the floor: unexplained
        dirs.append(_seg(tmp_path, f"l{t}", "ddp", "sync_local", 2, t, 0.001, 0.004, pair=f"r{t}", ems=3.0))
        dirs.append(_seg(tmp_path, f"r{t}", "ddp", "rays", 2, t, 0.0, 0.002 + 1e-4 * t, ems=3.0))
        dirs.append(_seg(tmp_path, f"e{t}", "ddp", em.FLOOR, 2, t, 0.0, 0.005, ems=3.0))
    d = study.derive(dirs)
    runs = {c["sampler"]: c for c in d["runs"] if c["emulated_step_ms"] == 2.0 or c["sampler"] == "sync_local"}
    g = runs["sync_global"]
    assert g["device"] == "emulated" and g["emulated_step_ms"] == 2.0 and g["ranks"] == 2 and g["trials"] == 3
    assert g["step_s_trials"] == pytest.approx([0.01] * 3) and g["stall_trials"] == pytest.approx([0.5] * 3)
    assert g["floor_step_s"] == pytest.approx(0.005) and g["step_over_floor"] == pytest.approx(2.0)
    assert g["stall_lockstep"] == pytest.approx(0.5)  # no sync above the floor's: the per-rank stall
    sp = {s["baseline"]: s for s in d["speedups"]}
    exp = [0.01 / 0.005, 0.01 / 0.0055, 0.01 / 0.006]
    glob = sp["sync_global"]
    assert glob["speedup_trials"] == pytest.approx(exp)
    m, ci = study.gmean_ci(exp)  # a ratio: geometric mean, interval of the logs
    assert m == pytest.approx(np.prod(exp) ** (1 / 3)) and ci[0] < m < ci[1]
    assert glob["speedup"] == pytest.approx(m) and glob["speedup_ci"] == pytest.approx(ci)
    assert glob["ideal_basis"] == "floor" and glob["ideal_speedup"] == pytest.approx(2.0)
    assert glob["stall_data"] == pytest.approx(0.5) and glob["ideal_speedup_wait"] == pytest.approx(2.0)
    assert glob["ratio"] == pytest.approx(m / 2.0) and glob["flags"] == []
    loc = sp["sync_local"]
    assert loc["ideal_speedup"] == pytest.approx(1.0) and loc["ideal_speedup_wait"] == pytest.approx(1.25)
    assert loc["speedup"] > 2.3
    assert any("above the ideal" in f for f in loc["flags"])
    assert any("pipelined step 0.42x the floor < 1/1.15" in f for f in loc["flags"]), loc["flags"]
    assert any("floor ran slow" in f for f in loc["flags"])  # it waits 20% but is no slower than the floor
    assert "faster than the floor" in loc["cause"]
    assert d["summary"]["flagged_pairs"] == 1 and d["summary"]["pairs"] == 2


def test_derive_without_a_floor_uses_the_wait(tmp_path):
    """No floor in the trials: the ideal is 1 / (1 - wait stall), and a flagged pair's cause
    decomposes the baseline's step against the pipelined one."""
    dirs = []
    for t in range(2):
        dirs.append(_seg(tmp_path, f"l{t}", "ddp", "sync_local", 2, t, 0.001, 0.004, pair=f"r{t}"))
        dirs.append(_seg(tmp_path, f"r{t}", "ddp", "rays", 2, t, 0.0, 0.002))
    loc = study.derive(dirs)["speedups"][0]
    assert loc["ideal_basis"] == "wait" and loc["ideal_speedup"] == pytest.approx(1.25) and loc["stall_data"] is None
    assert "forward" in loc["cause"] and "longer in the baseline" in loc["cause"]


def test_host_busy_from_the_ranks_cpu_time(tmp_path):
    """host busy = the ranks' process CPU per step, summed over ranks, over step x cores; a flagged
    pair's cause names it for the pipelined run and the floor."""
    dirs = []
    for t in range(2):
        dirs.append(_seg(tmp_path, f"g{t}", "ddp", "sync_global", 4, t, 0.004, 0.004, pair=f"p{t}", cpu=0.004))
        dirs.append(_seg(tmp_path, f"p{t}", "ddp", "rays", 4, t, 0.0, 0.006, cpu=0.0027))  # 1.5x the floor
        dirs.append(_seg(tmp_path, f"f{t}", "ddp", em.FLOOR, 4, t, 0.0, 0.004, cpu=0.0006))
    d = study.derive(dirs)
    runs = {c["sampler"]: c for c in d["runs"]}
    assert runs["rays"]["host_busy"] == pytest.approx(4 * 0.0027 / (0.006 * 2))
    assert runs[em.FLOOR]["host_busy"] == pytest.approx(4 * 0.0006 / (0.004 * 2))
    sp = d["speedups"][0]
    assert sp["flags"] and "cores 90% busy (the floor: 30%)" in sp["cause"]
    # runs written before cpu_s existed: no host busy, no error
    old = study.derive([_seg(tmp_path, "x", "ddp", "rays", 2, 0, 0.0, 0.005)])
    assert old["runs"][0]["host_busy"] is None


def test_git_commit_ignores_docs_study(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "docs" / "study").mkdir(parents=True)
    (tmp_path / "docs" / "study" / "report.md").write_text("a")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert study.git_commit(tmp_path) == head
    (tmp_path / "docs" / "study" / "report.md").write_text("regenerated")
    (tmp_path / "docs" / "study" / "new.png").write_text("png")
    assert study.git_commit(tmp_path) == head  # the report's own folder does not count
    (tmp_path / "code.py").write_text("x = 2\n")
    assert study.git_commit(tmp_path) == head + "-dirty"
    git("checkout", "code.py")
    (tmp_path / "untracked.py").write_text("")
    assert study.git_commit(tmp_path) == head + "-dirty"


def test_routed_torch_workers(tmp_path):
    """SS torch_workers: every ray crosses the cell, batches do not depend on the worker count,
    and state_dict resumes exactly."""
    from dali_nerf.config import PartitionConfig
    from dali_nerf.partition import Partition, ray_cells
    from dali_nerf.sources import RoutedTorchWorkers
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import load_scene

    make_scene("objects", tmp_path / "s", width=16, height=16, n_train=6, n_val=1, n_test=1)
    scene = load_scene(tmp_path / "s", split="train")
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)
    a = RoutedTorchWorkers(scene, part, cell=1, rays_per_batch=64, workers=0)
    b = RoutedTorchWorkers(scene, part, cell=1, rays_per_batch=64, workers=1)
    try:
        xs = [next(a) for _ in range(3)]
        ys = [next(b) for _ in range(3)]
        for x, y in zip(xs, ys):
            assert x["origins"].shape == (64, 3)
            assert torch.equal(x["origins"], y["origins"]) and torch.equal(x["indices"], y["indices"])
            keep = ray_cells(part, x["origins"].numpy(), x["directions"].numpy(), x["near"].numpy()[:, 0],
                             x["far"].numpy()[:, 0])[:, 1]
            assert keep.all()
        st = a.state_dict()
        nxt = next(a)
        a.load_state_dict(st)
        assert torch.equal(next(a)["origins"], nxt["origins"])
        with pytest.raises(ConfigError, match="cell"):
            a.load_state_dict(st | {"cell": 0})
    finally:
        a.close()
        b.close()
    with pytest.raises(ConfigError, match="cell=5"):
        RoutedTorchWorkers(scene, part, cell=5)


def test_registry_builds_ss_torch_workers(tmp_path):
    """method ss + pipeline.name=torch_workers: the registry gives one RoutedTorchWorkers per cell of
    the rank, sampling its own cell with pipeline.workers processes."""
    from dali_nerf.config import Config, PartitionConfig
    from dali_nerf.partition import Partition
    from dali_nerf.scenegen import make_scene
    from dali_nerf.scenes import load_scene
    from dali_nerf.sources import RoutedTorchWorkers, build_source

    make_scene("objects", tmp_path / "s", width=16, height=16, n_train=6, n_val=1, n_test=1)
    scene = load_scene(tmp_path / "s", split="train")
    part = Partition.from_config(PartitionConfig(grid=[2, 1]), scene)
    cfg = Config()
    cfg.pipeline.name, cfg.pipeline.rays_per_batch, cfg.pipeline.workers = "torch_workers", 32, 0
    srcs = build_source(cfg, scene, 1, 2, cells=[[0], [1]], partition=part)
    try:
        assert len(srcs) == 1 and isinstance(srcs[0], RoutedTorchWorkers)
        assert srcs[0].cell == 1 and srcs[0].workers == 0
        assert next(srcs[0])["origins"].shape == (32, 3)
    finally:
        for s in srcs:
            s.close()


@pytest.mark.slow
def test_launch_reports_a_failed_rank(tmp_path):
    """A rank that fails (here: a sampler with no emulated source) ends the launch with one error
    naming the rank's log, and no process is left waiting at the barrier."""
    from dali_nerf.config import load_config
    from dali_nerf.train.emulation import DeviceLinks
    from dali_nerf.errors import DaliNerfError
    from dali_nerf.scenegen import make_scene

    make_scene("objects", tmp_path / "s", width=16, height=16, n_train=4, n_val=1, n_test=1)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "study.yaml"),
                      [f"scene.path={tmp_path / 's'}"], check_paths=False)
    segs = [em.Segment("x", 0, 1.0, "bogus", 64, 0)]
    with pytest.raises(DaliNerfError, match=r"rank \d failed \(DaliNerfError: bench.samplers: 'bogus'.*rank\d.log"):
        em.launch(cfg, "ddp", 2, segs, tmp_path / "out", em.launch_budget(cfg, 2), DeviceLinks(), 0, 2, 1, timeout_s=30)
