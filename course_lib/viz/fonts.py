"""matplotlib's own fonts, always findable: no ``findfont: Font family ... not found`` in a learner's notebook.

Every log-scale axis labels its ticks with mathtext (``$10^{3}$``), and matplotlib's default math font set
(``mathtext.fontset = "dejavusans"``) loads its fallbacks on the first such label: the STIX fonts, the Computer
Modern ones (``cmmi10``, ...) and ``DejaVu Sans Display``, all shipped inside matplotlib (``mpl-data/fonts/ttf``).
matplotlib finds fonts through a font list it caches on disk (``fontlist-*.json`` in its cache folder); a list built
while matplotlib was still being installed, or copied from another machine, can lack the shipped fonts, and then
each lookup prints one warning line on stderr -- 21 lines in the first cell that draws a log axis.

:func:`register_shipped_fonts` adds every shipped font file the list lacks (the fonts are there: only the list is
stale). ``course_lib.viz`` calls it on import, so every figure of the course finds them.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib import font_manager


def shipped_font_files() -> list[Path]:
    """The TrueType fonts matplotlib ships (``mpl-data/fonts/ttf``)."""
    return sorted((Path(matplotlib.get_data_path()) / "fonts" / "ttf").glob("*.ttf"))


def register_shipped_fonts() -> list[Path]:
    """Add to matplotlib's font list every shipped font file it does not list; return the files added
    (none when the list is complete, the usual case)."""
    listed = {Path(f.fname).resolve() for f in font_manager.fontManager.ttflist}
    missing = [p for p in shipped_font_files() if p.resolve() not in listed]
    for path in missing:
        font_manager.fontManager.addfont(path)  # also clears findfont's cache of earlier misses
    return missing
