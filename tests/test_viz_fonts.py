"""A stale matplotlib font list (one that lacks the fonts matplotlib ships) must not print ``findfont`` warnings
in a course figure: ``course_lib.viz`` registers the shipped fonts (``course_lib/viz/fonts.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A fresh process whose font list has lost matplotlib's own fonts (what a cache built mid-install looks like),
# then a log-log figure: its tick labels are mathtext, whose fallbacks are STIX and Computer Modern.
STALE_THEN_DRAW = """
import io
from pathlib import Path
import matplotlib
from matplotlib import font_manager
shipped = Path(matplotlib.get_data_path()).resolve()
fm = font_manager.fontManager
fm.ttflist = [f for f in fm.ttflist if not Path(f.fname).resolve().is_relative_to(shipped)]
fm._findfont_cached.cache_clear()
{import_course}
from matplotlib.figure import Figure
fig = Figure()
fig.subplots().loglog([1, 10, 100], [1, 10, 100])
fig.savefig(io.BytesIO(), format="png")
print("drawn")
"""


def _draw_with_stale_fonts(import_course: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    out = subprocess.run([sys.executable, "-c", STALE_THEN_DRAW.format(import_course=import_course)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "drawn" in out.stdout, out.stderr
    return out


def test_a_stale_font_list_prints_findfont_warnings_without_the_course():
    """The reproduction is real: without ``course_lib.viz`` the figure prints the warnings seen in 04 and 09."""
    assert "findfont: Font family ['STIXGeneral'] not found" in _draw_with_stale_fonts("").stderr


def test_course_figures_find_the_shipped_fonts_even_with_a_stale_font_list():
    out = _draw_with_stale_fonts("import course_lib.viz")
    assert "findfont" not in out.stderr, out.stderr


def test_registering_twice_adds_nothing():
    from course_lib.viz.fonts import register_shipped_fonts, shipped_font_files

    assert shipped_font_files(), "matplotlib ships no TrueType fonts?"
    register_shipped_fonts()
    assert register_shipped_fonts() == []
