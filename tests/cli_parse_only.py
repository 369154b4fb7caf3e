"""Stand-in for the course's python in the teaching guide's test: ``python cli_parse_only.py -m MODULE ARGS...`` (or
``SCRIPT ARGS...``) runs the module as ``python -m`` would until its argparse parser has read the arguments, prints
what it parsed and exits 0; a bad argument exits 2 with the parser's message, a module without a parser exits 3.
Nothing is graded, built or written."""

from __future__ import annotations

import argparse
import runpy
import sys

_parse = argparse.ArgumentParser.parse_args


def _parse_only(self: argparse.ArgumentParser, args: list[str] | None = None,
                namespace: argparse.Namespace | None = None) -> argparse.Namespace:
    parsed = _parse(self, args, namespace)
    print(f"parsed {self.prog}: {sorted(vars(parsed).items())}", flush=True)
    raise SystemExit(0)


argparse.ArgumentParser.parse_args = _parse_only  # type: ignore[method-assign]
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
print("no argument parser ran", flush=True)
sys.exit(3)
