"""Class grading: a folder of three submissions (full marks, one function wrong, not a notebook) graded into a
gradebook CSV checked row by row, the summary per exercise, and the CLI's exit status (0 with a partial score
unless --strict)."""

from __future__ import annotations

import csv
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import gradebook

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "00_budgets.ipynb"
KV_RIGHT = "return 2 * n_layer * n_kv_head"
KV_WRONG = "return n_layer * n_kv_head"  # caches only the keys (tests/grading_fixtures/ch00.py: kv_forgets_values)


def _class_folder(root: Path) -> Path:
    """alice: the solution under a name without a chapter; bob: in his own sub-folder, kv_cache_bytes wrong;
    carol: a file that is not JSON, its chapter only in its name."""
    folder = root / "submissions"
    (folder / "bob").mkdir(parents=True)
    nb = nbformat.read(SOLUTION, as_version=4)
    nbformat.write(nb, folder / "alice.ipynb")
    broken = [c for c in nb.cells if KV_RIGHT in c.source]
    assert len(broken) == 1
    broken[0].source = broken[0].source.replace(KV_RIGHT, KV_WRONG)
    nbformat.write(nb, folder / "bob" / "homework final (2).ipynb")
    (folder / "carol-ch00.ipynb").write_text('{"cells": [ {"cell_type": "code", "source": "x = 1"')
    return folder


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> tuple[list[gradebook.GradeRow], Path]:
    folder = _class_folder(tmp_path_factory.mktemp("class"))
    rows = gradebook.grade_class(folder, time_limit=240, cell_timeout=60, progress=False)
    out = folder.parent / "gradebook.csv"
    gradebook.write_gradebook(rows, out)
    return rows, out


@pytest.mark.slow
def test_the_gradebook_csv_row_by_row(graded):
    _, out = graded
    with out.open() as f:
        table = list(csv.reader(f))
    assert table[0] == ["learner", "chapter", "exercise", "points", "max", "reason"]
    rows = [r[:5] for r in table[1:]]
    reasons = [r[5] for r in table[1:]]
    assert rows == [
        ["alice", "00", "param_state_bytes", "2", "2"],
        ["alice", "00", "zero_bytes_per_device", "3", "3"],
        ["alice", "00", "kv_cache_bytes", "2", "2"],
        ["alice", "00", "fewest_gpus", "3", "3"],
        ["alice", "00", "model_states_per_gpu", "2", "2"],
        ["bob", "00", "param_state_bytes", "2", "2"],
        ["bob", "00", "zero_bytes_per_device", "3", "3"],
        ["bob", "00", "kv_cache_bytes", "0", "2"],
        ["bob", "00", "fewest_gpus", "3", "3"],
        ["bob", "00", "model_states_per_gpu", "2", "2"],
        ["carol-ch00", "00", "param_state_bytes", "0", "2"],
        ["carol-ch00", "00", "zero_bytes_per_device", "0", "3"],
        ["carol-ch00", "00", "kv_cache_bytes", "0", "2"],
        ["carol-ch00", "00", "fewest_gpus", "0", "3"],
        ["carol-ch00", "00", "model_states_per_gpu", "0", "2"],
    ]
    for i in (0, 1, 2, 3, 4, 5, 6, 8, 9):
        assert "checks passed" in reasons[i], reasons[i]
    assert reasons[7].startswith("the visible check") and "kv_cache_bytes" in reasons[7]
    assert all(r.startswith("not a readable notebook (") for r in reasons[10:])


@pytest.mark.slow
def test_the_summary_counts_passes_and_the_common_failure_reasons(graded, tmp_path):
    rows, _ = graded
    summary = {s.exercise: s for s in gradebook.summarize(rows)}
    assert list(summary) == ["param_state_bytes", "zero_bytes_per_device", "kv_cache_bytes", "fewest_gpus",
                             "model_states_per_gpu"]
    assert (summary["param_state_bytes"].passed, summary["param_state_bytes"].submitted) == (2, 3)
    kv = summary["kv_cache_bytes"]
    assert (kv.passed, kv.submitted) == (1, 3)
    assert sorted(n for _, n in kv.common_failures) == [1, 1]
    assert {reason.split(" ")[0] for reason, _ in kv.common_failures} == {"the", "not"}
    gradebook.write_summary(list(summary.values()), tmp_path / "s.csv")
    with (tmp_path / "s.csv").open() as f:
        table = list(csv.reader(f))
    assert table[0] == ["chapter", "exercise", "passed", "submitted", "common_failures"]
    assert table[3][:4] == ["00", "kv_cache_bytes", "1", "3"] and "1 x the visible check" in table[3][4]


def test_the_chapter_comes_from_metadata_or_the_file_name():
    assert gradebook.chapter_from_name(Path("alice_01_collectives.ipynb")) == "01"
    assert gradebook.chapter_from_name(Path("2026_ch05.ipynb")) == "05"  # 2026 is not a chapter number
    assert gradebook.chapter_from_name(Path("alice.ipynb")) is None
    assert gradebook.chapter_from_name(Path("99_nothing.ipynb")) is None  # no such chapter


def test_the_cli_exits_zero_with_a_partial_score_unless_strict(tmp_path, capsys):
    """Without starting a kernel: a file that is not a notebook and a notebook with no chapter."""
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "dave_00.ipynb").write_text("not json")
    nbformat.write(nbformat.v4.new_notebook(), folder / "erin.ipynb")
    out = tmp_path / "book.csv"
    assert gradebook.main([str(folder), "--out", str(out)]) == 0
    assert gradebook.main([str(folder), "--out", str(out), "--strict"]) == 1
    with out.open() as f:
        table = list(csv.reader(f))
    assert [r[:5] for r in table[1:]] == [
        ["dave_00", "00", "param_state_bytes", "0", "2"],
        ["dave_00", "00", "zero_bytes_per_device", "0", "3"],
        ["dave_00", "00", "kv_cache_bytes", "0", "2"],
        ["dave_00", "00", "fewest_gpus", "0", "3"],
        ["dave_00", "00", "model_states_per_gpu", "0", "2"],
        ["erin", "", "", "0", "0"],
    ]
    assert "cannot tell the chapter" in table[6][5]
    assert gradebook.summary_path(out).exists()
    with pytest.raises(SystemExit) as exc:
        gradebook.main(["--help"])
    assert exc.value.code == 0
    assert "--strict" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gradebook.main([str(tmp_path / "empty_or_missing")])
