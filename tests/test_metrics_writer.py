"""metrics.jsonl survives a kill mid-line and a full disk is one line (no traceback)."""

import json

import pytest

from dali_nerf.errors import DaliNerfError
from dali_nerf.train.runlog import MetricsWriter as _MetricsWriter


def test_resume_drops_lines_after_checkpoint_and_a_torn_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    w = _MetricsWriter(p, resume_step=4)
    w.write({"step": 5, "loss": 0.5})
    w.close()
    steps = [json.loads(l)["step"] for l in p.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_write_failure_is_one_line(tmp_path):
    w = _MetricsWriter(tmp_path / "metrics.jsonl", resume_step=0)
    w.f.close()
    w.f = open("/dev/full", "w")  # every flush fails with ENOSPC
    w.write({"step": 1})
    with pytest.raises(DaliNerfError, match=r"metrics.jsonl: cannot write metrics .*resume with --resume"):
        w.flush()
    w.close()
