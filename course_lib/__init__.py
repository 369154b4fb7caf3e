"""course_lib: every kind of LLM parallelism, built from scratch on real torch.distributed ranks.

One concept per module: ``launch`` (ranks from a notebook cell), ``comm`` (every byte counted), ``model``
(a tiny GPT and real model shapes), ``data``, ``train`` (the single-process baseline and parity checks),
``parallel/`` (dp, zero, tp, pp, cp, ep), ``memory``, ``cost``, ``schedules`` and ``viz``.
"""

__version__ = "0.1.0"
