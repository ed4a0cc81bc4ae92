"""bench/default_job.py's variants (settings compared side by side) and how bench/publish.py tabulates its runs."""
import pytest

from bench import default_job, publish


def test_variants_gather_their_overrides_in_order():
    assert default_job.parse_variants([]) == {"": ()}  # the runs as they are
    assert default_job.parse_variants(["a:x.y=1", 'b:z="s"', "a:w=2"]) == {"a": ("x.y=1", "w=2"), "b": ('z="s"',)}


@pytest.mark.parametrize("spec", ["nokv", ":x=1", "a b:x=1", "a:x"])
def test_a_variant_without_a_name_or_a_setting_is_refused(spec):
    with pytest.raises(SystemExit, match="--variant"):
        default_job.parse_variants([spec])


def _run(name: str, step_s: float, evals: dict) -> dict:
    return {"name": name, "precision": "int8", "steps": 10, "s_per_step": step_s, "gen_tokens_per_s": 150.0,
            "stage_s": {"generate": 7.0, "reference": 4.0, "learn": 15.0, "sync": 1.5},
            "learn_split_s": {"forward": 5.0, "backward": 9.5, "optimizer": 0.5}, "eval": evals,
            "memory": {"per_role_peak": {"learner": {"rss": 7e9, "pss": 6.5e9}}, "peak_rss": 1.2e10, "peak_pss": 1.1e10,
                       "others_cores": 0.0}}


def test_runs_without_evaluations_are_tabulated_by_stage_and_memory_only():
    lines = publish.default_job({"runs": [_run("s0_int8_passive", 29.3, {}), _run("s0_int8_auto", 25.1, {})]})
    text = "\n".join(lines)
    assert "Held-out" not in text  # run.eval = false: nothing learned is claimed
    rows = [x for x in lines if x.startswith("| s0_int8_")]
    assert [r.split(" | ")[0] for r in rows] == ["| s0_int8_passive", "| s0_int8_auto"] * 2  # stages, then memory
    assert "| 29.3 |" in rows[0] and "| 25.1 |" in rows[1]
