"""Graded exercises: the checks of every chapter and the papermill grader.

* ``core``: ``CheckResult``, ``Exercise`` and the helpers checks are written with (compare tensors, first
  difference, a time limit).
* ``chNN`` (one module per chapter): the exercises of chapter NN; each has a ``check_<name>(fn, ...)`` function
  that the notebook's visible self-check cell calls, and hidden variants (other world sizes, shapes, seeds) that only
  the grader runs.
* ``notebooks``: exercise notebooks generated from solution notebooks (``### BEGIN SOLUTION`` blocks stripped).
* ``grader`` and ``python -m course_lib.grading``: run a learner's notebook with papermill in a child process with a
  time limit, then the hidden checks, and print a score report; ``papermill_child`` is that child, ``in_kernel`` the
  grading cell it runs last in the learner's kernel.
"""

import sys

# The grading processes (the grader, its papermill child, the gradebook, the timings) read notebooks with nbformat,
# which imports jsonschema's format checkers; the IRI one (rfc3987-syntax, installed with JupyterLab) builds a
# grammar as it is imported: 1.2-1.6 s per process, for a format no notebook schema uses. jsonschema leaves that
# format unchecked when the module is missing; nothing else in these processes needs it.
sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[assignment]
