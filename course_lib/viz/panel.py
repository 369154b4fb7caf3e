"""What every course widget shares: named controls that code can set in one go (one recompute, one redraw),
redraws on a learner's change, and figures rendered off-screen into an ``Image`` widget (whatever matplotlib's
backend), so the same widget works in JupyterLab, under nbval, in a grader and in a browser test.

Two browser behaviours every panel handles the same way:

* a slider being dragged sends every intermediate value, and a redraw per value queues up behind a busy
  kernel (the text and the figure then lag apart): every control reports only its final value
  (``continuous_update=False``), so a drag redraws once;
* on a focused, closed dropdown JupyterLab takes the arrow keys as notebook shortcuts and moves the active cell
  (a ``<select>`` is not an editable element to it; jupyter-widgets/ipywidgets#3912), and a kernel-side widget
  cannot stop a browser event: a panel with dropdowns says, in the panel and in each list's tooltip, to open
  the list first (a click, or Alt+ArrowDown), where the arrow keys do choose.
"""

from __future__ import annotations

import io
from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes (for ``ipywidgets.Image``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def show_figures(*pairs: tuple[W.Image, Figure | None]) -> None:
    """Put each figure into its ``Image``; hide an image whose figure is None (no empty image: no broken-image
    icon)."""
    for image, fig in pairs:
        image.value = figure_png(fig) if fig else b""
        image.layout.display = None if fig else "none"


KEYBOARD_HINT = ("Lists: click one (or press Alt+ArrowDown) to open it, then choose with the arrow keys and Enter."
                 " On a closed list JupyterLab keeps the arrow keys for moving between cells.")
INTERACTIVE_ONLY = "course-keyboard-hint"
"""The CSS class of what only helps a live widget (the keyboard hint): the static site leaves it out."""


class ControlPanel(W.VBox):
    """A VBox of named controls. Subclasses fill ``self.controls`` ({name: control}), call ``self._watch()`` and
    implement ``update()`` (recompute and redraw) and ``text`` (what the widget shows, as plain text).

    ``set(**values)`` is how notebooks, graders and tests drive a widget: unknown names raise ``KeyError``;
    ``_prepare`` may normalise values and ``_assign`` may order or chain them (override either).
    """

    controls: dict[str, W.ValueWidget]
    _busy: bool = False  # True while code sets several controls: their observers must not redraw each time

    def _watch(self) -> None:
        """Observe every control (call after filling ``self.children``); see :meth:`_settle_controls`."""
        for w in self.controls.values():
            w.observe(self._on_change, names="value")
        self._settle_controls()

    def _settle_controls(self) -> None:
        """Final values only (a slider drag redraws once), and the keyboard hint below a panel with dropdowns."""
        for w in self.controls.values():
            if w.has_trait("continuous_update"):
                w.continuous_update = False
        lists = [w for w in self.controls.values() if isinstance(w, W.Dropdown)]
        if not lists or any(isinstance(c, W.Label) and c.value == KEYBOARD_HINT for c in self.children):
            return
        for w in lists:
            w.tooltip = w.tooltip or KEYBOARD_HINT
        hint = W.Label(KEYBOARD_HINT, style={"font_size": "11px", "text_color": "#666"})
        hint.add_class(INTERACTIVE_ONLY)
        self.children = (*self.children, hint)

    def values(self) -> dict[str, Any]:
        """{control name: current value}."""
        return {k: w.value for k, w in self.controls.items()}

    def set(self, **values: Any) -> str:
        """Set controls by name, recompute and redraw once; return :attr:`text`."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise KeyError(f"unknown control(s) {sorted(unknown)}; choose from {list(self.controls)}")
        values = self._prepare(values)
        self._busy = True
        try:
            self._assign(values)
        finally:
            self._busy = False
        self.update()
        return self.text

    def _prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        return values

    def _assign(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.controls[k].value = v

    def _on_change(self, change: dict) -> None:
        if not self._busy:
            self.update()

    def update(self) -> None:
        raise NotImplementedError

    @property
    def text(self) -> str:
        raise NotImplementedError
