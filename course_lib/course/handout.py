"""The learners' handout: the course without its solutions, standing on its own.

    python -m course_lib.course.handout handout/          # or: make handout (OUT=handout/)

Writes a folder a teacher can zip, push to a learners' repository or copy onto a JupyterHub:

* ``notebooks/`` (the chapters, executed, outputs included) and ``exercises/`` (generated from the solutions, with
  every ``### BEGIN SOLUTION`` block replaced by a hint and no outputs);
* ``course_lib/`` whole, ``course_lib/grading/`` included: the exercises' visible self-checks call it. This means the
  hidden test cases ship too (they are parameters in ``course_lib/grading/chNN.py``, not answers); a learner who
  reads them learns which settings are tested, not the code to write;
* ``benchmarks/`` and, from ``tests/``, only the files the shipped text cites (``tests/test_pp.py`` ...), with
  ``tests/conftest.py``: the rest of ``tests/`` holds the grader's fixtures, worked wrong answers next to right ones;
* its own ``README.md`` (``course_lib/course/handout_files/README.md``: set up, open, work on a copy, grade; the chapter
  list is read from the notebooks' titles), a ``Makefile`` with the learners' targets only (``setup``, ``lab``,
  ``my-copy``, ``grade``, ``benchmarks`` ... and what they depend on: no ``test`` or ``handout``; ``exercises``
  says the exercises are ready),
  whose set-up installs the course without the test tools (``make setup`` installs ``.[test]`` only where
  ``solutions/`` is), an ``environment.yml`` without them either, ``pyproject.toml``, ``LICENSE``, ``.gitignore``.

Never copied: ``solutions/``, the rest of ``tests/``, ``docs/`` (the teacher's guide), ``.venv``, caches.

The handout is refused while ``exercises/`` is out of date with ``solutions/`` (run ``make exercises`` first) or
when the shipped text cites a file that does not exist, and checked after writing: no notebook in it contains a
solution block.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tomllib
from pathlib import Path

import nbformat

from course_lib.grading import notebooks

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("notebooks", "exercises", "course_lib", "benchmarks", "jupyter")
FILES = ("pyproject.toml", "LICENSE", ".gitignore")
WRITTEN = ("README.md", "Makefile", "environment.yml")
TEMPLATES = Path(__file__).with_name("handout_files")
LEARNER_TARGETS = ("setup", "lab", "my-copy", "grade", "benchmarks", "torch-plan", "clean")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info")
SOLUTION_MARK = "### BEGIN SOLUTION"
CITED = re.compile(r"(?<![\w/.])(?:tests|docs|examples)/[\w./-]*\w")
"""A path into a folder the handout leaves out, as the chapters and docstrings write it (``tests/test_cp.py``)."""
EXERCISES_RULE = ("## exercises/ comes ready here (the course makes it from its solutions): work on your copy.\n"
                  "exercises:\n"
                  '\t@echo "exercises/ is ready in this copy; make my-copy gives you your own in $(MY_WORK)/"')
"""Replaces the course's ``make exercises``, which needs ``solutions/``: a folder of that name would otherwise make
``make exercises`` answer "up to date" and do nothing."""
_RULE = re.compile(r"^([^\s#=:][^=:]*?):(?!=)(.*)$", re.MULTILINE)


class HandoutError(RuntimeError):
    pass


def solution_leaks(folder: Path) -> list[Path]:
    """Notebooks under ``folder`` that still contain a solution block, and any ``solutions`` folder."""
    leaks = [p for p in folder.rglob("*.ipynb") if SOLUTION_MARK in p.read_text(errors="replace")]
    return leaks + [p for p in folder.rglob("solutions") if p.is_dir()]


def cited_paths(folder: Path) -> set[str]:
    """Every path into tests/, docs/ or examples/ that the notebooks, Python files and READMEs under ``folder``
    mention."""
    found = set()
    for path in folder.rglob("*"):
        if path.suffix in (".ipynb", ".py", ".md") and path.is_file():
            found.update(m.rstrip(".") for m in CITED.findall(path.read_text(errors="replace")))
    return found


def learner_makefile(text: str, targets: tuple[str, ...] = LEARNER_TARGETS) -> str:
    """The course's Makefile cut down to ``targets`` and the rules they depend on: its paragraphs (separated by
    blank lines) that define no rule or one of those, in order; the first paragraph, the header, and the ``.PHONY``
    line replaced by the learners' own."""
    paragraphs = text.strip("\n").split("\n\n")
    rules = {}  # target -> (paragraph index, its prerequisites)
    for i, para in enumerate(paragraphs):
        for names, prereqs in _RULE.findall(para):
            for name in names.split():
                rules[name] = (i, prereqs.replace("|", " ").split())
    keep, todo = set(), [t for t in targets if t in rules]
    while todo:
        i, prereqs = rules[todo.pop()]
        if i not in keep:
            keep.add(i)
            todo += [p for p in prereqs if p in rules]
    kept_targets = [t for t in rules if rules[t][0] in keep and t != ".PHONY"] + ["exercises"]
    out = ["# The course's commands for learners: make setup, make lab, make my-copy, make grade NB=... (README.md)"]
    for i, para in enumerate(paragraphs[1:], 1):
        if ".PHONY" in rules and rules[".PHONY"][0] == i:
            out.append(".PHONY: " + " ".join(t for t in kept_targets if not t.startswith("$")))
        elif i in keep or not _RULE.search(para):
            out.append(para)
    return "\n\n".join([*out, EXERCISES_RULE]) + "\n"


def learner_environment(text: str, pyproject: str) -> str:
    """``environment.yml`` without the test tools (the ``test`` extra of ``pyproject.toml``)."""
    tools = set(tomllib.loads(pyproject)["project"]["optional-dependencies"]["test"])
    return "".join(line for line in text.splitlines(keepends=True) if line.strip().removeprefix("- ") not in tools)


def exercises_of(folder: Path, chapter: Path) -> Path | None:
    """The exercise notebook of a chapter in ``folder``: ``exercises/NN_topic.ipynb`` or
    ``exercises/NN_topic_exercises.ipynb`` for ``notebooks/NN_topic.ipynb`` (None for the start page)."""
    for name in (chapter.name, f"{chapter.stem}_exercises.ipynb"):
        if chapter.name[:2].isdigit() and (folder / "exercises" / name).exists():
            return folder / "exercises" / name
    return None


def learner_readme(folder: Path) -> str:
    """The handout's README: the template, with one line per chapter (its title, START_HERE first) and a link to its
    exercises."""
    lines = []
    for nb in sorted((folder / "notebooks").glob("*.ipynb"), key=lambda nb: (nb.stem != "START_HERE", nb.name)):
        cells = nbformat.read(nb, as_version=4).cells
        title = next(c.source for c in cells if c.cell_type == "markdown").splitlines()[0].lstrip("# ")
        line = f"- [{title}](notebooks/{nb.name})"
        exercises = exercises_of(folder, nb)
        if exercises is not None:
            line += f" · [exercises](exercises/{exercises.name})"
        lines.append(line)
    return (TEMPLATES / "README.md").read_text().replace("{chapters}", "\n".join(lines))


def write_handout(out: Path, repo: Path = REPO) -> list[Path]:
    """Copy the learners' part of ``repo`` into ``out`` (which must not exist or be empty). Returns what was copied."""
    stale = notebooks.sync(repo / "solutions", repo / "exercises", check=True)
    if stale:
        raise HandoutError(f"exercises/ is out of date with solutions/ ({', '.join(p.name for p in stale)}): "
                           "run `make exercises` first")
    if out.exists() and any(out.iterdir()):
        raise HandoutError(f"{out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in FOLDERS:
        copied.append(Path(shutil.copytree(repo / name, out / name, ignore=IGNORED)))
    for name in FILES:
        copied.append(Path(shutil.copy2(repo / name, out / name)))
    (out / "Makefile").write_text(learner_makefile((repo / "Makefile").read_text()))
    pyproject = (repo / "pyproject.toml").read_text()
    (out / "environment.yml").write_text(learner_environment((repo / "environment.yml").read_text(), pyproject))
    (out / "README.md").write_text(learner_readme(out))
    copied += [out / name for name in WRITTEN]
    copied += _copy_cited(out, repo)
    leaks = solution_leaks(out)
    if leaks:
        raise HandoutError(f"solutions found in the handout: {[str(p) for p in leaks]}")
    return copied


def _copy_cited(out: Path, repo: Path) -> list[Path]:
    """Copy each file the handout cites (and what the copies cite in turn); tests/ comes with its conftest."""
    copied: list[Path] = []
    while missing := sorted(p for p in cited_paths(out) if not (out / p).exists()):
        for rel in missing:
            if not (repo / rel).is_file():
                raise HandoutError(f"the handout cites {rel}, which is not a file of the course")
            for name in [rel] + (["tests/__init__.py", "tests/conftest.py"] if rel.startswith("tests/") else []):
                if not (out / name).exists():
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    copied.append(Path(shutil.copy2(repo / name, out / name)))
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.handout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a new (or empty) folder for the handout")
    args = parser.parse_args(argv)
    try:
        copied = write_handout(args.out)
    except HandoutError as exc:
        print(f"handout: {exc}", file=sys.stderr)
        return 1
    print(f"wrote the handout to {args.out}: {', '.join(sorted({p.relative_to(args.out).parts[0] for p in copied}))}"
          " (no solutions/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
