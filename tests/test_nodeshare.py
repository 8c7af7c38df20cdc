"""Memory shared by the ranks of a node (dali_nerf/data/nodeshare.py), in real processes: each
rank fills its part, all read the whole, the pages are counted once per node in PSS, the memory is
gone when the last rank lets go, and a rank whose node partner is missing fails in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dali_nerf.data.nodeshare import NodeShare
from dali_nerf.errors import DataError

REPO = Path(__file__).resolve().parent.parent
NBYTES = 8 << 20

_CHILD = r"""
import json, os, sys, time
import numpy as np
from dali_nerf.data.nodeshare import NodeShare
rank, world, key, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
n = int(sys.argv[5])

def wait_all(tag):
    open(os.path.join(folder, f"{tag}{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(folder, f"{tag}{r}")) for r in range(world)):
        time.sleep(0.01)

def mem():
    rss = pss = 0
    cur = False
    for line in open("/proc/self/smaps"):
        f = line.split()
        if len(f) >= 5 and "-" in f[0]:
            cur = "dali_nerf-blk" in line
        elif cur and f[0] == "Rss:":
            rss += int(f[1])
        elif cur and f[0] == "Pss:":
            pss += int(f[1])
    return rss, pss

share = NodeShare(key, rank, world, timeout=60)
if len(sys.argv) > 6:  # the failure case: rank 1 fails its part, the others' wait fails in one line
    b = share.block("bad", 64)
    try:
        b.fill_part(lambda a, part, parts: (_ for _ in ()).throw(OSError("disk gone")) if part == 1 else None)
        b.wait_ready()
        msg = "no error"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    json.dump({"msg": msg}, open(os.path.join(folder, f"out{rank}.json"), "w"))
    wait_all("done")
    share.close()
    sys.exit(0)
blk = share.block("blk", n)
def fill(a, part, parts):
    lo, hi = n * part // parts, n * (part + 1) // parts
    a[lo:hi] = np.arange(lo, hi) % 251
blk.fill_part(fill)
a = blk.wait_ready()
ok = bool((a == np.arange(n) % 251).all())   # every part, read by this rank (its pages faulted in)
wait_all("read")
rss, pss = mem()
wait_all("measured")
del a  # no view left: the mapping goes with release()
blk.release()
wait_all("released")
left = sum("dali_nerf-blk" in l for l in open("/proc/self/maps"))
json.dump({"ok": ok, "rss_kb": rss, "pss_kb": pss, "left": left, "threads": len(os.listdir("/proc/self/task"))},
          open(os.path.join(folder, f"out{rank}.json"), "w"))
wait_all("done")
share.close()
"""


def _run(tmp_path, world, key, n=NBYTES, fail=False):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    extra = ["fail"] if fail else []
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), key, str(tmp_path), str(n)] + extra,
                              cwd=REPO, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(world)]


def test_three_ranks_fill_one_block_that_counts_once_per_node(tmp_path):
    got = _run(tmp_path, 3, f"test-share-{os.getpid()}")
    for g in got:
        assert g["ok"] and g["left"] == 0
        assert g["rss_kb"] >= NBYTES // 1024 * 0.99
        assert abs(g["pss_kb"] - g["rss_kb"] / 3) <= 0.02 * g["rss_kb"], g  # each page counted 1/3 per rank
    assert abs(sum(g["pss_kb"] for g in got) - NBYTES / 1024) <= 0.02 * NBYTES / 1024


def test_one_rank_needs_no_socket_and_a_missing_partner_is_one_line():
    share = NodeShare(f"solo-{os.getpid()}", 0, 1)
    blk = share.block("x", 100)
    blk.fill_part(lambda a, part, parts: a.__setitem__(slice(None), 7))
    assert (blk.wait_ready() == 7).all() and share._sock is None
    with pytest.raises(ValueError):
        blk.array[0] = 1  # read-only once ready
    blk.release()
    share.close()
    with pytest.raises(DataError, match="local rank 0 did not open its share within 0.3 s") as e:
        NodeShare(f"nobody-{os.getpid()}", 1, 2, timeout=0.3)
    assert "\n" not in str(e.value)
    np.testing.assert_array_equal(np.zeros(1), 0)


def test_a_rank_that_fails_its_part_fails_the_block_on_every_rank(tmp_path):
    got = _run(tmp_path, 2, f"test-fail-{os.getpid()}", fail=True)
    assert got[1]["msg"] == "OSError: disk gone"
    assert got[0]["msg"].startswith("DataError: node share") and "failed to fill its part of bad" in got[0]["msg"]
