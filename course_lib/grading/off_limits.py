"""An answer must be the learner's own code: calling (or inheriting) the library's implementation of an exercise
scores nothing.

Each ``Exercise`` names the library objects that *are* its answer (``off_limits``: dotted paths such as
``"course_lib.parallel.schedules.zb_h1"`` or ``"course_lib.runtime.mesh.MeshShape.coords"``). Before any check runs,
``library_answer`` inspects the learner's answer statically, without running it:

* a function: every global it loads, followed along attribute chains (``schedule_run.add_grad_reduce``,
  ``course_lib.parallel.schedules.zb_h1``, ``ca.BlockAttention().merge``, a local holding ``MeshShape(...)`` and then
  ``.coords``), every closure cell, every nested function, and every helper function or class of the learner's
  that it references, recursively;
* a class: its bases (an off-limits class may not be subclassed), the methods it would inherit (an off-limits
  method reached through the MRO is the library's answer, e.g. ``class FixedKernel(ca.BlockAttention): pass``),
  and the code of the methods it defines (``super().kv_for_backward_step(...)`` included).

Its limit, stated: a reference built at run time from strings (``getattr(module, "zb" + "_h1")``) is not seen.
The check's hidden cases still have to pass, and the gradebook's summary shows surprising full marks.
"""

from __future__ import annotations

import builtins
import dis
import importlib
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

_MISSING = object()
_LIBRARY_ROOTS = ("course_lib", "torch", "numpy", "nbformat")


def resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"off-limits path {path!r} names no module")


def _unwrap(obj: Any) -> Any:
    """The function behind a bound method, a staticmethod or a classmethod (else ``obj``)."""
    return getattr(obj, "__func__", obj)


def _is_learners(obj: Any) -> bool:
    """Code the learner wrote: not the course's library, not an installed package, not the standard library."""
    module = getattr(obj, "__module__", None) or ""
    top = module.split(".")[0]
    if top in _LIBRARY_ROOTS or top in sys.stdlib_module_names or top == "builtins":
        return False
    file = getattr(sys.modules.get(module), "__file__", None) or ""
    return "site-packages" not in file and "dist-packages" not in file


def _safe_attr(obj: Any, name: str) -> Any:
    """``getattr`` on modules and classes only (an instance's attribute could run a property)."""
    if not isinstance(obj, types.ModuleType | type):
        return _MISSING
    try:
        return getattr(obj, name)
    except Exception:  # a lazy module attribute may raise anything
        return _MISSING


class UnknownReceiver(str):
    """An attribute loaded from a value the inspection cannot follow (an instance built with arguments, a
    parameter): only its name is known."""


def references(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """(how it is spelled, object) for every global, closure value and attribute chain that ``fn``'s code (and its
    nested functions') loads; ``("super().name", name)`` for a method called through ``super()``, and
    ``("?.name", UnknownReceiver(name))`` for an attribute of a value it cannot follow."""
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    yield from _code_references(fn.__code__, fn.__globals__, cells)


def _code_references(code: types.CodeType, globals_: dict[str, Any],
                     cells: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    chain: tuple[str, Any] | None = None  # the value on top of the stack, when we know it
    local_values: dict[str, tuple[str, Any]] = {}
    after_super = False
    for ins in dis.get_instructions(code):
        op, arg = ins.opname, ins.argval
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            value = globals_.get(arg, getattr(builtins, arg, _MISSING))
            after_super = after_super or value is super
            chain = None if value is super else (arg, value)
        elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
            cell = cells.get(arg)
            try:
                chain = (arg, cell.cell_contents) if cell is not None else None
            except ValueError:  # an empty cell
                chain = None
        elif op == "LOAD_FAST":
            chain = local_values.get(arg)
        elif op in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
            if after_super or op == "LOAD_SUPER_ATTR":
                yield f"super().{arg}", arg
                after_super, chain = False, None
            elif chain is not None:
                chain = (f"{chain[0]}.{arg}", _safe_attr(chain[1], arg))
            else:
                yield f"?.{arg}", UnknownReceiver(arg)
        elif op in ("PRECALL", "CALL", "PUSH_NULL", "KW_NAMES", "CACHE", "PRECALL_FUNCTION", "CALL_FUNCTION"):
            if chain is not None and not isinstance(chain[1], type):
                chain = None  # calling a class gives an instance: its methods are the class's; else unknown
            continue
        elif op == "STORE_FAST":
            if chain is not None:
                local_values[arg] = chain
            else:
                local_values.pop(arg, None)
            chain = None
            continue
        else:
            chain = None
            continue
        if chain is not None and chain[1] is not _MISSING:
            yield chain
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_references(const, globals_, {})


def _owner(path: str) -> Any:
    """The class a method's dotted path goes through (``course_lib.runtime.mesh.MeshShape.coords`` -> ``MeshShape``)."""
    return resolve(path.rsplit(".", 1)[0])


def library_answer(answer: Any, off_limits: Sequence[str], name: str = "the answer") -> str | None:
    """Why ``answer`` is (or leans on) the library's implementation, or None when it is the learner's own."""
    if not off_limits:
        return None
    objects = {p: resolve(p) for p in off_limits}
    banned = {id(_unwrap(o)): p for p, o in objects.items()}
    classes = [(p, o) for p, o in objects.items() if isinstance(o, type)]
    methods = [(p, _unwrap(o)) for p, o in objects.items()
               if not isinstance(o, type) and "." in p and isinstance(_owner(p), type)]
    method_names = {m.__name__: p for p, m in methods}
    why = ("it is the library's implementation of this exercise: write it yourself (off limits here: "
           f"{', '.join(off_limits)})")
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = [(name, answer)]
    while todo:
        spelled, obj = todo.pop()
        obj = _unwrap(obj)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if id(obj) in banned:
            alias = "" if spelled == banned[id(obj)] else f" = {banned[id(obj)]}"
            return f"{name} uses {spelled}{alias}: {why}"
        if isinstance(obj, type):
            for path, cls in classes:
                if obj is not cls and issubclass(obj, cls):
                    return f"{name}: {obj.__name__} subclasses {path}: {why}"
            for path, method in methods:
                if _unwrap(getattr(obj, method.__name__, None)) is method:
                    return f"{name}: {obj.__name__}.{method.__name__} is inherited from {path}: {why}"
            if _is_learners(obj):
                todo += [(f"{obj.__name__}.{k}", v) for k, v in vars(obj).items()
                         if isinstance(v, types.FunctionType | staticmethod | classmethod | property | type)]
        elif isinstance(obj, property):
            todo += [(spelled, f) for f in (obj.fget, obj.fset) if f is not None]
        elif isinstance(obj, types.FunctionType) and _is_learners(obj):
            refs = list(references(obj))
            loaded = {id(ref) for _, ref in refs}
            for ref_spelled, ref in refs:
                if ref_spelled.startswith("super().") and ref in method_names:
                    return f"{name} calls {ref_spelled} = {method_names[ref]}: {why}"
                if isinstance(ref, UnknownReceiver):
                    # an instance's method: off limits when the function also names the method's class
                    owner = next((p for p, m in methods if m.__name__ == ref and id(_owner(p)) in loaded), None)
                    if owner:
                        return f"{name} calls .{ref}() on a {_owner(owner).__name__} = {owner}: {why}"
                    continue
                todo.append((ref_spelled, ref))
    return None
