"""bench/omp_wait.py at a tiny shape: each wait's decode step timed in fresh processes with that wait's environment."""
import json

import pytest

from bench import omp_wait


@pytest.mark.slow  # `make test-slow` (docs/testing.md)
def test_each_wait_runs_in_its_own_processes_and_is_summarised(tmp_path):
    out = tmp_path / "omp_wait.json"
    res = omp_wait.main(["--model", "tiny-qwen2", "--precision", "int8", "--rows", "1", "2", "--steps", "2",
                         "--context", "16", "--rounds", "1", "--waits", "passive", "spin:2000", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == res["summary"]
    assert [r["wait"] for r in res["runs"]] == ["passive", "spin:2000"]
    assert res["runs"][1]["env"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "2000"}
    for s in res["summary"]:
        assert s["alone_ms_1"] > 0 and s["alone_ms_2"] > 0 and "shared_ms_1" not in s
    assert res["command"].startswith(".venv/bin/python bench/omp_wait.py") and res["machine"]


def test_an_unknown_wait_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--waits: 'busy'"):
        omp_wait.main(["--waits", "busy"])
