"""The teacher's guide's commands work as written, with the course's environment: every command of
``docs/teaching.md`` (its ``bash`` blocks and the commands quoted in its text) is a ``make`` target of the course's
Makefile, run with its options, or ``.venv/bin/python`` on a module or script of the course (a plain ``python`` has
none of its packages: "No module named 'nbformat'"). Each runs for real up to the argument parser of the module it
calls (``tests/cli_parse_only.py`` stands in for the python), so a wrong option, a missing target or a module that
does not exist fails here; nothing is graded, built or written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.grading import teaching_table, timings

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "teaching.md"
STUB = [sys.executable, str(REPO / "tests" / "cli_parse_only.py")]
RUN_THROUGH = {"grade", "handout", "site", "my-copy", "exercises"}
"""Targets whose recipe only calls the course's python: run with the stand-in. Others (lab, test, setup...) would
start servers or test suites: checked with ``make -n``."""
ENV = {"SLURM_ARRAY_TASK_ID": "1"}
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:make|\.venv/bin/python|python3?)(?:\s|$)")


def guide_commands(text: str) -> list[str]:
    """The commands of ``bash`` blocks (comments dropped, continued lines joined) and the commands quoted inline
    (a code span of two words or more that starts with make or a python; ``-m ...`` is a placeholder), as
    written."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                found.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)]
    found += [s for s in spans if COMMAND.match(s) and len(s.split()) > 1 and "..." not in s.split()]
    return list(dict.fromkeys(found))


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory) -> Path:
    """A folder laid out like the course for `make`: its Makefile and pyproject.toml, a class folder."""
    where = tmp_path_factory.mktemp("guide")
    for name in ("Makefile", "pyproject.toml"):
        (where / name).symlink_to(REPO / name)
    (where / "submissions").mkdir()
    return where


def _run(command: str, scaffold: Path) -> subprocess.CompletedProcess:
    for name, value in ENV.items():
        command = command.replace(f"${name}", value)
    words = shlex.split(command)
    if words[0] == "make":
        make = ["make", "-s", "--no-print-directory", f"VENV={REPO / '.venv'}", "PIP_TORCH=2.13.0+cpu"]
        if words[1] in RUN_THROUGH and len(words) > 2:  # with its options: run, up to the module's parser
            make.append(f"PY={shlex.join(STUB)}")
        else:  # a target named in the text, or one that starts servers or test suites: what it would run
            make.append("-n")
        return subprocess.run([*make, *words[1:]], cwd=scaffold, capture_output=True, text=True, timeout=300)
    assert words[0] == ".venv/bin/python", f"{command}: run the course's python, .venv/bin/python"
    return subprocess.run([*STUB, *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_guide_quotes_its_commands():
    commands = guide_commands(GUIDE.read_text())
    assert len(commands) >= 12, commands
    assert any(c.startswith("make grade NB=submissions/ JOBS=") for c in commands)  # a class, with its options


@pytest.mark.slow  # a python start and the module's imports per command: about 2 s each, more under load
@pytest.mark.parametrize("command", guide_commands(GUIDE.read_text()))
def test_every_command_of_the_guide_works_as_written(command, scaffold):
    assert not re.match(r"^(?:[A-Z_]+=\S+\s+)*python3?\s", command), \
        f"{command!r}: a plain python lacks the course's packages; write .venv/bin/python"
    done = _run(command, scaffold)
    assert done.returncode == 0, f"{command!r} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    words = command.split()
    if words[0] == ".venv/bin/python" or (words[1] in RUN_THROUGH and len(words) > 2):
        assert "parsed " in done.stdout, f"{command!r} called no course module: {done.stdout[-1000:]}"


def test_a_wrong_option_or_a_plain_python_fails(scaffold):
    """The check can fail: an option the module does not have, a target the Makefile does not have."""
    assert _run(".venv/bin/python -m course_lib.grading.gradebook submissions/ --jobz 2", scaffold).returncode == 2
    assert _run("make grade NB=submissions/ GRADE_ARGS=--jobz", scaffold).returncode != 0
    assert _run("make gradee NB=submissions/", scaffold).returncode != 0
    site = "python -m course_lib.course.site site/"
    assert guide_commands(f"`{site}` and `make`") == [site]


def test_the_generated_tables_are_the_registry_and_the_measurements():
    """docs/teaching.md's Run All table and grading times, and the README's `make test` line: what the grader's
    registry and docs/timings.json say, written by the generator."""
    problems = teaching_table.drift()
    assert not problems, "run `.venv/bin/python -m course_lib.grading.teaching_table`:\n" + "\n".join(problems)


def test_a_hand_written_row_or_a_stale_time_is_caught():
    store = timings.load()
    texts = {path: path.read_text() for path, _ in teaching_table.BLOCKS.values()}
    table = teaching_table.run_all_table(store)
    assert "| start | `START_HERE.ipynb` |" in table  # the start page's row is generated like the others
    assert all(f"`{nb.name}`" in table for nb in (REPO / "notebooks").glob("*.ipynb"))
    end = teaching_table.END.format(name="run-all")
    typed = {**texts, GUIDE: texts[GUIDE].replace(end, "| 11 | `11_extra.ipynb` | 9.9 | 2 | - | - |\n" + end)}
    assert teaching_table.drift(typed, store)[0].startswith("teaching.md, block 'run-all'")
    stale = {k: dict(v) for k, v in store["run_all"].items()}
    first = next(iter(stale))
    stale[first]["seconds"] += 1
    assert teaching_table.drift(texts, {**store, "run_all": stale})
    later = {**store, "make_test": {**store["make_test"], "seconds": [60.0]}}
    assert [p.split(",")[0] for p in teaching_table.drift(texts, later)] == ["README.md"]
    gone = {**texts, GUIDE: texts[GUIDE].replace(end, "")}
    assert "missing" in teaching_table.drift(gone, store)[0]
    assert teaching_table.regenerate(typed, store) == texts
