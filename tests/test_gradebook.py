"""Class grading: a folder of three submissions (full marks, one function wrong, not a notebook) graded into a
gradebook CSV checked row by row, the summary per exercise, and the CLI's exit status (0 with a partial score
unless --strict)."""

from __future__ import annotations

import csv
from dataclasses import astuple
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import canary, cli, gradebook, grader

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "00_budgets_exercises.ipynb"
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
def test_grading_two_at_a_time_gives_the_same_gradebook(graded, tmp_path):
    """--jobs 2: the same rows in the same order as one at a time (they finish in any order)."""
    rows, _ = graded
    folder = _class_folder(tmp_path)
    parallel = gradebook.grade_class(folder, time_limit=240, cell_timeout=60, progress=False, jobs=2)
    assert [r[:5] for r in map(astuple, parallel)] == [r[:5] for r in map(astuple, rows)]


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
        ["carol", "00", "param_state_bytes", "0", "2"],
        ["carol", "00", "zero_bytes_per_device", "0", "3"],
        ["carol", "00", "kv_cache_bytes", "0", "2"],
        ["carol", "00", "fewest_gpus", "0", "3"],
        ["carol", "00", "model_states_per_gpu", "0", "2"],
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


def test_the_cli_exits_zero_with_a_partial_score_unless_strict(tmp_path, capsys, monkeypatch):
    """Without starting a kernel: a file that is not a notebook and a notebook with no chapter (the canary, which
    would grade chapter 00's solution, is tested on its own)."""
    monkeypatch.setattr(canary, "check", lambda *a, **k: None)
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
        ["dave", "00", "param_state_bytes", "0", "2"],
        ["dave", "00", "zero_bytes_per_device", "0", "3"],
        ["dave", "00", "kv_cache_bytes", "0", "2"],
        ["dave", "00", "fewest_gpus", "0", "3"],
        ["dave", "00", "model_states_per_gpu", "0", "2"],
        ["erin", "", "", "0", "0"],
    ]
    assert "cannot tell the chapter" in table[6][5]
    with gradebook.totals_path(out).open() as f:
        assert list(csv.reader(f)) == [["learner", "points", "max", "chapters"], ["dave", "0", "12", "00"],
                                       ["erin", "0", "0", ""]]
    assert gradebook.summary_path(out).exists()
    with pytest.raises(SystemExit) as exc:
        gradebook.main(["--help"])
    assert exc.value.code == 0
    assert "--strict" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gradebook.main([str(tmp_path / "empty_or_missing")])


def test_a_learner_is_a_sub_folder_or_a_file_name_without_its_chapter(tmp_path):
    folder = tmp_path / "alice"
    for name, learner in (("bob/handin.ipynb", "bob"), ("carol.ipynb", "carol"), ("dave_01.ipynb", "dave"),
                          ("ch05-erin.ipynb", "erin"), ("frank 06_context_parallel.ipynb", "frank"),
                          ("01_collectives.ipynb", "alice"), ("08.ipynb", "alice"),  # alice's own folder
                          ("03_zero_fsdp_exercises.ipynb", "alice"), ("gus_03_zero_fsdp_exercises.ipynb", "gus")):
        assert gradebook.learner_of(folder / name, folder) == learner, name


def test_every_chapter_is_told_by_its_metadata_or_its_content_whatever_the_file_name(tmp_path):
    """A renamed (alice.ipynb) and a nested (bob/handin.ipynb) exercise notebook of every chapter: the chapter from
    metadata.course.chapter; with that metadata removed, from the cell that imports the chapter's checks."""
    for exercise in sorted((REPO / "exercises").glob("*.ipynb")):
        nb = nbformat.read(exercise, as_version=4)
        assert nb.metadata["course"]["chapter"] == exercise.name[:2], exercise.name
        for path in (tmp_path / "alice.ipynb", tmp_path / "bob" / "handin.ipynb"):
            assert grader.notebook_chapter(path, nb) == exercise.name[:2]
        del nb.metadata["course"]
        assert grader.chapter_from_content(nb) == exercise.name[:2], exercise.name
        assert grader.notebook_chapter(tmp_path / "handin.ipynb", nb) == exercise.name[:2]


def _fake_grading(monkeypatch):
    """grade_submission without a kernel: every exercise of the file's chapter, half the points for ben; the
    canary passes (it is graded for real in test_grading_canary.py)."""
    def fake(path, learner, *args, **kwargs):
        chapter = gradebook.chapter_from_name(path) or "00"
        return [gradebook.GradeRow(learner, chapter, ex.key, ex.points // (2 if learner == "ben" else 1),
                                   ex.points, "fake") for ex in grader.chapter_module(chapter).EXERCISES]
    monkeypatch.setattr(gradebook, "grade_submission", fake)
    monkeypatch.setattr(canary, "check", lambda *a, **k: None)


def test_a_failed_canary_stops_the_class_before_any_submission(tmp_path, monkeypatch, capsys):
    """One line on stderr, exit status 3, no gradebook written, nothing graded; the canary saw the class's
    chapters (from metadata, content or name) and the run's limits."""
    graded, seen = [], []
    monkeypatch.setattr(gradebook, "grade_submission", lambda *a, **k: graded.append(a) or [])
    monkeypatch.setattr(canary, "check", lambda ch, *a: seen.append((sorted(ch), a)) or "the cause. Fix: x.")
    folder = tmp_path / "class"
    folder.mkdir()
    for name in ("ann_00", "ben_05", "cat_05"):
        (folder / f"{name}.ipynb").write_text("{}")
    out = tmp_path / "book.csv"
    assert gradebook.main([str(folder), "--out", str(out), "--jobs", "2", "--time-limit", "99"]) == 3
    assert capsys.readouterr().err == "error: the cause. Fix: x.\n"
    assert not graded and not list(tmp_path.glob("book*.csv"))
    assert seen[0][0] == ["00", "05", "05"] and seen[0][1][0] == 99 and seen[0][1][3] == 2


def test_shards_merged_are_the_class_graded_at_once(tmp_path, monkeypatch, capsys):
    """Three shards of a class of seven submissions cover each once; --merge joins their CSVs into the same
    gradebook (rows, summary, totals) as grading the class in one run."""
    _fake_grading(monkeypatch)
    folder = tmp_path / "class"
    for name in ("ann_00", "ann_01", "ben_00", "ben_05", "cat_00", "cat_08", "dan_01"):
        (folder / f"{name}.ipynb").parent.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.ipynb").write_text("{}")
    everything = gradebook.grade_class(folder, progress=False)
    parts = []
    for i in (1, 2, 3):
        part = tmp_path / f"part{i}.csv"
        assert gradebook.main([str(folder), "--shard", f"{i}/3", "--out", str(part), "--jobs", "2"]) == 0
        parts.append(part)
    shard_files = [gradebook.shard_of(gradebook.find_submissions(folder), (i, 3)) for i in (1, 2, 3)]
    assert sorted(p for s in shard_files for p in s) == gradebook.find_submissions(folder)
    assert gradebook.main(["--merge", *map(str, parts), "--out", str(tmp_path / "all.csv")]) == 0
    assert gradebook.read_gradebook(tmp_path / "all.csv") == sorted(everything, key=lambda r: (r.learner, r.chapter))
    totals = {t.learner: (t.points, t.max) for t in gradebook.totals(everything)}
    with gradebook.totals_path(tmp_path / "all.csv").open() as f:
        assert {r[0]: (int(r[1]), int(r[2])) for r in list(csv.reader(f))[1:]} == totals
    out = capsys.readouterr().out
    assert "ann: " in out and "4 learner(s)" in out
    with pytest.raises(SystemExit) as exc:  # the same shard twice
        gradebook.main(["--merge", str(parts[0]), str(parts[0]), "--out", str(tmp_path / "twice.csv")])
    assert exc.value.code == 2
    for bad in ("0/3", "4/3", "x"):
        with pytest.raises(SystemExit) as exc:
            gradebook.main([str(folder), "--shard", bad])
        assert exc.value.code == 2


def test_the_grader_cli_exits_2_with_one_line_for_a_path_it_cannot_grade(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# not a notebook")
    (tmp_path / "broken.ipynb").write_text("not json")
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "blank.ipynb")
    for path, why in ((tmp_path / "missing.ipynb", "no such file"), (tmp_path / "notes.md", "not a notebook"),
                      (tmp_path / "broken.ipynb", "not a readable notebook"),
                      (tmp_path / "blank.ipynb", "cannot tell the chapter")):
        assert cli.main([str(path)]) == 2, path
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
