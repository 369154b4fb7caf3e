"""Figures (matplotlib) and widgets (ipywidgets) for the chapters, one module per topic.

Each module keeps the plotting function (pure: data in, ``Figure`` out, testable without a browser) apart from the
widget that wires controls to it.
"""
