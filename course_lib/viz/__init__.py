"""Figures (matplotlib) and widgets (ipywidgets) for the chapters, one module per topic.

Each module keeps the plotting function (pure: data in, ``Figure`` out, testable without a browser) apart from the
widget that wires controls to it.

The figures need matplotlib's own fonts; a stale font cache can hide them (see :mod:`course_lib.viz.fonts`).
"""

from course_lib.viz.fonts import register_shipped_fonts

register_shipped_fonts()
