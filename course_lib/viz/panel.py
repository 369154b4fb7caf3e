"""What every course widget shares: named controls that code can set in one go (one recompute, one redraw),
redraws on a learner's change, and figures rendered off-screen into an ``Image`` widget (whatever matplotlib's
backend), so the same widget works in JupyterLab, under nbval, in a grader and in a browser test.
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


class ControlPanel(W.VBox):
    """A VBox of named controls. Subclasses fill ``self.controls`` ({name: control}), call ``self._watch()`` and
    implement ``update()`` (recompute and redraw) and ``text`` (what the widget shows, as plain text).

    ``set(**values)`` is how notebooks, graders and tests drive a widget: unknown names raise ``KeyError``;
    ``_prepare`` may normalise values and ``_assign`` may order or chain them (override either).
    """

    controls: dict[str, W.ValueWidget]
    _busy: bool = False  # True while code sets several controls: their observers must not redraw each time

    def _watch(self) -> None:
        for w in self.controls.values():
            w.observe(self._on_change, names="value")

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
