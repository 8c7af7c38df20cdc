"""scripts/gpu_study.sh, the GPU machine's run: its step runner (exit codes, time limits, numbers
kept when a step is cut short), the DALI pieces' checksums (a corrupt, missing or stray piece is
refused before unpacking) and the dry run (every step on the CPU at toy sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIB = REPO / "scripts" / "gpu_lib.sh"


def bash(script: str, tmp_path: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """``script`` in a bash that sourced gpu_lib.sh, with OUT_DIR / STEPS / T0 / TOTAL set."""
    pre = f'source "{LIB}"; OUT_DIR="{tmp_path}"; STEPS="{tmp_path}/steps.txt"; T0=$SECONDS; TOTAL=100; FAILED=0\n'
    return subprocess.run(["bash", "-c", pre + script], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def steps(tmp_path: Path) -> list:
    return (tmp_path / "steps.txt").read_text().splitlines()


def test_run_step_reports_exit_codes_time_limits_and_budget(tmp_path):
    t0 = time.monotonic()
    r = bash("""
        run_step fine 10 true; echo "fine=$?"
        run_step bad 10 bash -c 'echo half > "$0/bad.json"; exit 3' "$OUT_DIR"; echo "bad=$?"
        run_step self124 10 bash -c 'exit 124'; echo "self124=$?"
        run_step slow 5 bash -c 'echo "{\\"rows\\": 1}" > "$0/partial.json"; sleep 60' "$OUT_DIR"; echo "slow=$?"
        run_step late 4 true; echo "late=$?"
        echo "FAILED=$FAILED"
    """, tmp_path)
    assert time.monotonic() - t0 < 30, "the time limit did not stop the slow step"
    out = r.stdout
    for expect in ("fine=0", "bad=3", "self124=124", "slow=124", "late=1", "FAILED=1"):
        assert expect in out, out
    lines = steps(tmp_path)
    assert lines[0].startswith("RAN fine: ok in ")
    assert lines[1].startswith("FAILED bad: exit 3 after ") and "bad.log" in lines[1]
    assert lines[2].startswith("FAILED self124: exit 124 after ")  # a quick exit 124 is not a timeout
    assert lines[3].startswith("FAILED slow: timed out after 5s")
    assert lines[4].startswith("SKIPPED late: time budget spent")
    assert json.loads((tmp_path / "partial.json").read_text()) == {"rows": 1}  # written before the limit: kept
    assert (tmp_path / "bad.json").read_text() == "half\n"
    assert (tmp_path / "slow.log").read_text().startswith("== slow (limit 5s): bash -c")


def _pack(tmp_path: Path) -> Path:
    """A fake DALI site as scripts/gpu_pack_dali.sh packs one: tar | xz, 3 pieces, sha256 file."""
    site = tmp_path / "fake_site"
    (site / "nvidia" / "dali").mkdir(parents=True)
    (site / "nvidia" / "__init__.py").write_text("# nvimgcodec's\n")
    (site / "nvidia" / "dali" / "__init__.py").write_text("__version__ = 'fake'\n" + "#" * 30000 + "\n")
    whl = tmp_path / "whl"
    whl.mkdir()
    with tarfile.open(tmp_path / "site.tar", "w") as tf:
        tf.add(site, arcname=".")
    subprocess.run(["xz", "-T0", "-6", "-k", str(tmp_path / "site.tar")], check=True)
    subprocess.run(["split", "-n", "3", "-d", "-a", "1", str(tmp_path / "site.tar.xz"),
                    str(whl / "dali_site.tar.xz.part")], check=True)
    pack = (REPO / "scripts" / "gpu_pack_dali.sh").read_text()
    line = next(x for x in pack.splitlines() if "> .whl/dali_site.sha256" in x)  # the pack script's own command
    subprocess.run(["bash", "-c", line.replace(".whl", str(whl))],
                   check=True, cwd=tmp_path)
    return whl


def test_pieces_are_checked_before_unpacking(tmp_path):
    whl = _pack(tmp_path)
    sums = (whl / "dali_site.sha256").read_text().split()
    assert sums[1::2] == [f"dali_site.tar.xz.part{i}" for i in range(3)]
    site = tmp_path / "site"
    r = bash(f'verify_pieces "{whl}"; echo "rc=$?"', tmp_path)
    assert r.stdout.count("ok dali_site.tar.xz.part") == 3 and "rc=0" in r.stdout, r.stdout

    # a corrupt piece is refused, named, and nothing is unpacked
    p1 = whl / "dali_site.tar.xz.part1"
    good = p1.read_bytes()
    p1.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    r = bash(f'unpack_pieces "{whl}" "{site}"; echo "rc=$?"', tmp_path)
    assert f"corrupt piece {p1}" in r.stdout and "carry it again" in r.stdout and "rc=1" in r.stdout, r.stdout
    assert not site.exists()
    p1.write_bytes(good)

    # intact: unpacked in order, the shared nvidia/ namespace kept, a second call does nothing
    r = bash(f'run_step dali 30 unpack_pieces "{whl}" "{site}"; echo "rc=$?"', tmp_path)
    assert "rc=0" in r.stdout, (r.stdout, (tmp_path / "dali.log").read_text())
    assert (site / "nvidia" / "dali" / "__init__.py").read_text().startswith("__version__ = 'fake'")
    assert not (site / "nvidia" / "__init__.py").exists()
    assert "already unpacked" in bash(f'unpack_pieces "{whl}" "{site}"', tmp_path).stdout

    # missing, stray, and no checksum file
    (whl / "dali_site.tar.xz.part2").rename(tmp_path / "p2")
    (whl / "dali_site.tar.xz.part7").write_bytes(b"old")
    r = bash(f'verify_pieces "{whl}"; echo "rc=$?"', tmp_path)
    assert "missing piece" in r.stdout and "part2" in r.stdout and "stray piece" in r.stdout and "part7" in r.stdout
    assert "rc=1" in r.stdout
    (whl / "dali_site.sha256").unlink()
    r = bash(f'verify_pieces "{whl}"; echo "rc=$?"', tmp_path)
    assert "no " in r.stdout and "gpu_pack_dali.sh" in r.stdout and "rc=1" in r.stdout


def test_bad_arguments_exit_2(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_study.sh"), "--no-such-flag"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_study.sh"), "--dry-run"],
                       env={**env, "GPU_STUDY_TOTAL": "9m"}, capture_output=True, text=True)
    assert r.returncode == 2 and "GPU_STUDY_TOTAL=9m" in r.stderr


def test_run_build_says_when_no_compiler_ran(tmp_path):
    lib = tmp_path / "cache" / "cuda-x" / "lib.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    (lib.parent / "builds.log").write_text("{}\n")
    os.utime(lib.parent / "builds.log", (time.time() - 60,) * 2)  # compiled a minute ago
    compile_ = 'echo "{}" >> "$0/builds.log"; echo "$0/lib.so"'
    r = bash(f"""
        run_build reused 10 echo "{lib}"; echo "reused=$?"
        run_build compiled 10 bash -c '{compile_}' "{lib.parent}"; echo "compiled=$?"
        run_build other 10 echo "{tmp_path}/no-such.so"; echo "other=$?"
        run_build bad 10 bash -c 'echo "$0"; exit 3' "{lib}"; echo "bad=$?"
    """, tmp_path)
    for expect in ("reused=0", "compiled=0", "other=0", "bad=3"):
        assert expect in r.stdout, r.stdout + r.stderr
    lines = steps(tmp_path)
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"RAN reused: reused {lib} (built before this step: no compiler ran); ok in "), lines
    assert lines[1].startswith("RAN compiled: ok in "), lines
    assert lines[2].startswith("RAN other: ok in "), lines  # no library to look at: run_step's line
    assert lines[3].startswith("FAILED bad: exit 3 after "), lines


@pytest.mark.slow
def test_gpu_study_dry_run(tmp_path, cuda_plugin):
    """``scripts/gpu_study.sh --dry-run`` runs every step on the CPU at toy sizes (the build step,
    which reuses the session's nvcc build (conftest.py) and says so, the loop benchmark, the emulated
    study on the study's grid and the scene it made, time to quality, the splat trainer, decode,
    the gpu tests' collection and skips), one line per step with its reason; nothing fails."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_STUDY_WORK": str(tmp_path / "work")}
    if cuda_plugin is not None:
        env.update(DALI_NERF_CUDA_ARCHS=cuda_plugin.env["DALI_NERF_CUDA_ARCHS"],
                   GPU_STUDY_PLUGIN_CACHE=str(cuda_plugin.cache))
        builds = {p: p.read_text() for p in cuda_plugin.cache.glob("cuda-*/builds.log")}
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_study.sh"), "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    # a device call brings back at most 8 files named in [A-Za-z0-9._-]: the results come packed
    back = sorted(p.name for p in out.iterdir())
    assert back == ["README.txt", "gpu_study.tar.gz", "steps.txt"], back
    with tarfile.open(out / "gpu_study.tar.gz") as tf:
        # filter="data" where this Python has it (3.10.12 / 3.11.4 on; Debian 12's python3 is 3.11.2)
        tf.extractall(tmp_path / "res", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert (tmp_path / "res" / "steps.txt").read_text() == (out / "steps.txt").read_text()
    out = tmp_path / "res"
    lines = (out / "steps.txt").read_text().splitlines()
    assert len(lines) >= 10 and all(l.split(" ", 1)[0] in ("RAN", "SKIPPED") and ": " in l for l in lines), lines
    ran = {l.split(":")[0].split(" ", 1)[1] for l in lines if l.startswith("RAN ")}
    expect = {"dali", "make-scene", "loop", "study-host", "ttq", "splat", "decode", "gpu-tests"}
    if cuda_plugin is not None:
        expect.add("build")
    assert expect <= ran, lines
    if cuda_plugin is not None:  # the session's library reused: no compiler ran in the dry run
        lib = Path(cuda_plugin.build.stdout.strip().splitlines()[-1])
        (build,) = [l for l in lines if l.startswith("RAN build: ")]
        assert build.startswith(f"RAN build: reused {lib} "), build
        assert {p: p.read_text() for p in cuda_plugin.cache.glob("cuda-*/builds.log")} == builds
    loop = json.loads((out / "loop" / "loop.json").read_text())
    assert loop["meta"]["phase_timing"] == "host" and loop["device_steps"] and loop["rows"]
    (derived,) = (out / "study").glob("*/derived.json")
    meta = json.loads(derived.read_text())["meta"]
    # the CPU machine's grid (configs/study.yaml) on the scene the script made: the same rays, the named step
    assert meta["rays_grid"] == [4096, 16384, 65536] and [d["name"] for d in meta["device_steps"]] == ["measured"]
    assert meta["scenes"]["main"].startswith(str(tmp_path / "work" / "objects_32x8"))
    assert (derived.parent / "report.md").is_file()
    s = json.loads((out / "ttq" / "summary.json").read_text())
    assert s["stopped_by"] == "max_seconds" and len(s["eval_curve"]) >= 2
    splat = json.loads((out / "splat" / "summary.json").read_text())
    assert splat["method"] == "splat" and splat["steps"] == 4 and splat["rasteriser"] == "torch"
    assert json.loads((out / "decode" / "decode.json").read_text())["rows"]
    assert "SKIPPED" in (out / "gpu-tests.log").read_text()


def test_pieces_mode_fails_only_for_what_carrying_again_fixes(tmp_path):
    """``gpu_study.sh --pieces`` between the carrying calls: pieces still to come are listed, exit 0;
    a corrupt piece exits 1."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    whl = repo / ".whl"
    whl.mkdir()
    for i in (0, 1):
        (whl / f"dali_site.tar.xz.part{i}").write_bytes(bytes([i]) * 1000)
    subprocess.run("sha256sum dali_site.tar.xz.part0 dali_site.tar.xz.part1 > dali_site.sha256", shell=True,
                   cwd=whl, check=True)
    (whl / "dali_site.tar.xz.part1").unlink()  # not carried yet
    run = lambda: subprocess.run(["bash", str(repo / "scripts" / "gpu_study.sh"), "--pieces"], capture_output=True,  # noqa: E731
                                 text=True)
    r = run()
    assert r.returncode == 0 and "ok dali_site.tar.xz.part0" in r.stdout and "missing piece" in r.stdout, r.stdout
    (whl / "dali_site.tar.xz.part0").write_bytes(b"\x01" * 1000)
    r = run()
    assert r.returncode == 1 and "corrupt piece" in r.stdout, r.stdout
