"""docs/performance.md is what bench/published/ gives now (bench/publish.py writes it), and every published result
carries the command that produced it and the machine it ran on."""
import json

import pytest

from qgrpo.bench.publish import COMMAND, DOC, PUBLISHED, SECTIONS, load, render


def test_performance_page_is_generated_from_the_published_results():
    assert DOC.is_file(), f"{DOC} is missing; generate it with `{COMMAND}`"
    assert DOC.read_text() == render(), f"{DOC} is out of date with bench/published/; regenerate it with `{COMMAND}`"


def test_every_published_result_is_on_the_page_with_its_command_and_machine():
    page = render()
    prose = " ".join(page.split())  # the page wraps its lines
    for path in sorted(PUBLISHED.glob("*.json")):
        data = json.loads(path.read_text())
        assert str(data.get("command") or "").strip() and str(data.get("machine") or "").strip(), path
        assert f"Machine: {' '.join(data['machine'].split())}. JSON: `bench/published/{path.name}`" in prose, path
        for command in data["command"].split("\n"):
            assert "\n" + command[:60] in page, f"{path.name}: command not on the page: {command}"


def test_a_result_without_command_or_machine_is_refused(tmp_path, monkeypatch):
    import qgrpo.bench.publish as publish

    stem = SECTIONS[0][1][0][0]
    data = json.loads((PUBLISHED / f"{stem}.json").read_text())
    del data["machine"]
    (tmp_path / f"{stem}.json").write_text(json.dumps(data))
    monkeypatch.setattr(publish, "PUBLISHED", tmp_path)
    with pytest.raises(ValueError, match="machine"):
        load(stem)


def test_figures_on_the_page_come_from_the_json():
    # The learner-memory table shows each variant's peak RSS as the JSON holds it (GB = 2**30 bytes as the bench
    # writes it), so a renderer reading the wrong field or unit fails here.
    page = render()
    rows = json.loads((PUBLISHED / "learner_memory.json").read_text())["rows"]
    for row in rows:
        assert f"| {row['variant']} |" in page and f"| {row['peak_rss_gb']:.2f} |" in page
