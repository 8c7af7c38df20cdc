"""The data path's fingerprints (scripts/fingerprints.py) equal the record in tests/data/fingerprints.json:
the batches every source hands out (the operator's bit for bit; the torch baselines' pixels and
colours) and the threads / run size / priority / device each config gives a rank. A change to a
stream or to a plan shows here by name; a deliberate one rewrites the record
(``python scripts/fingerprints.py --write tests/data/fingerprints.json``) in the same commit, which
says why."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("fingerprints", REPO / "scripts" / "fingerprints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fingerprints_equal_the_record():
    fp = _script()
    want = json.loads((REPO / "tests" / "data" / "fingerprints.json").read_text())
    got = fp.fingerprints()
    assert set(got["streams"]) == set(want["streams"]) and set(got["plans"]) == set(want["plans"])
    bad = fp.diff(want, got)
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_changed_stream_and_plan():
    fp = _script()
    want = {"streams": {"a": "00"}, "plans": {"p": [{"num_threads": 1, "type": "RayLoader"}]}}
    assert fp.diff(want, want) == []
    assert fp.diff(want, {"streams": {"a": "01"}, "plans": want["plans"]}) == ["streams/a: recorded '00', now '01'"]
    moved = fp.diff(want, {"streams": want["streams"], "plans": {"p": [{"num_threads": 2, "type": "RayLoader"}]}})
    assert moved == ["plans/p[0]: num_threads recorded 1, now 2"]
    assert fp.diff(want, {"streams": want["streams"], "plans": {"p": [{"num_threads": 1, "type": "RayLoader",
                                                                         "new": 3}]}}) == []
