"""An exercise's answer may use only the ``course_lib`` objects its ``Exercise.allowed`` names; the rest of the
library is refused, however the answer reaches it.

``allowed`` holds dotted paths (``"course_lib.comm"``, ``"course_lib.parallel.cp_attention.BlockAttention.forward"``).
A path permits itself and what lies under it: a module's own functions and classes, a class's methods (those it
inherits from the library included). A module or class on the way to a permitted path may be imported, named,
instantiated and subclassed, but a class's library methods must each be permitted, inherited ones too.

``static_refusal`` reads the answer's code without running it: every name it loads, in its functions, methods and
helpers (imports inside them, aliases, attribute chains, defaults, closures, ``super()``), the bases of its classes
and the library methods they inherit, what ``getattr``, ``vars``, ``sys.modules``, ``importlib.import_module`` and
``__import__`` return for constant strings (concatenated, formatted or joined), and the top-level statements that
compute the data it reads (a table filled by the library in a cell). What it cannot see (a name computed at run
time) ``course_lib.grading.runtime_guard`` refuses while the checks run.
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import importlib
import importlib.util
import inspect
import linecache
import os
import site
import sys
import sysconfig
import types
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

LIBRARIES = ("course_lib", "torch.distributed.pipelining")
"""What the allow-list guards: the course's library, and PyTorch's pipeline schedules (each runs a whole pipeline
step, the answer of chapter 05's step exercises). Their objects are "the library's" here."""
LIBRARY_DIRS = tuple(os.path.abspath(d) + os.sep for name in LIBRARIES
                     for d in (importlib.util.find_spec(name).submodule_search_locations or ()))
_INSTALLED = tuple(dict.fromkeys(
    os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                          *sysconfig.get_paths().values(), *site.getsitepackages()) if p))
LIBRARY_CODE, INSTALLED_CODE, LEARNER_CODE = "library", "installed", "learner"


def code_kind(filename: str) -> str:
    """Whose code a file holds: the course's library, Python's or an installed package's (``<string>`` code from
    ``exec`` and dataclasses included), or the learner's (a notebook cell, a file of their own)."""
    if filename.startswith(LIBRARY_DIRS):
        return LIBRARY_CODE
    if filename.startswith("<") or filename.startswith(_INSTALLED):
        return INSTALLED_CODE
    return LEARNER_CODE


def in_library(name: str) -> bool:
    """Whether a module's dotted name lies in one of the ``LIBRARIES``."""
    return any(name == root or name.startswith(root + ".") for root in LIBRARIES)


def library_path(obj: Any) -> str | None:
    """The dotted path of a module, class, function, method or property of the ``LIBRARIES``; None for anything
    else."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        obj = function_of(obj)
        if not isinstance(obj, type | types.FunctionType):
            return None
        name = f"{getattr(obj, '__module__', None)}.{obj.__qualname__}"
    return name if in_library(name) else None


def function_of(obj: Any) -> Any:
    """The function behind a bound method, a staticmethod, a classmethod, a property or a cached property."""
    if isinstance(obj, property):
        return obj.fget
    if isinstance(obj, cached_property):
        return obj.func
    return getattr(obj, "__func__", obj)


def _nested_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested_codes(const)


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
    raise ImportError(f"allowed path {path!r} names no module")


@dataclass(frozen=True)
class Allowed:
    """What one exercise's answer may use: ``paths`` as the exercise declares them."""

    paths: tuple[str, ...]

    def permits(self, path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in self.paths)

    def leads_to(self, path: str) -> bool:
        """A module or class on the way to a permitted path (it may be named, not used for more)."""
        return self.permits(path) or any(p.startswith(path + ".") for p in self.paths)

    def offers(self, cls: type | None, fn: Any) -> bool:
        """Whether ``fn`` is a method of a permitted class along ``cls``'s bases (inherited by it or not)."""
        name = getattr(fn, "__name__", "")
        return cls is not None and any(
            (path := library_path(k)) and self.permits(path)
            and function_of(inspect.getattr_static(k, name, None)) is fn for k in cls.__mro__)

    def describe(self) -> str:
        return ", ".join(self.paths) if self.paths else "nothing from course_lib"

    @cached_property
    def _objects(self) -> list[Any]:
        return [resolve(p) for p in self.paths]

    @cached_property
    def files(self) -> frozenset[str]:
        """The files of the permitted modules: all their code is permitted."""
        return frozenset(os.path.abspath(o.__file__) for o in self._objects
                         if isinstance(o, types.ModuleType) and getattr(o, "__file__", None))

    @cached_property
    def codes(self) -> frozenset[types.CodeType]:
        """The code objects of the permitted functions, methods and classes (their library bases' methods too)."""
        found: set[types.CodeType] = set()
        for obj in self._objects:
            if isinstance(obj, type):
                for cls in obj.__mro__:
                    if library_path(cls):
                        found.update(c for v in vars(cls).values() for c in _codes_of(v))
            else:
                found.update(_codes_of(obj))
        return frozenset(found)

    def permits_code(self, code: types.CodeType) -> bool:
        return code.co_filename in self.files or code in self.codes


def _codes_of(obj: Any) -> Iterator[types.CodeType]:
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            yield from _codes_of(f)
        return
    fn = function_of(obj)
    while isinstance(fn, types.FunctionType):  # and what a decorator wraps (a contextmanager's generator)
        yield from _nested_codes(fn.__code__)
        fn = getattr(fn, "__wrapped__", None)


@functools.lru_cache(maxsize=1)
def _library_codes_of(modules: frozenset[str]) -> dict[types.CodeType, str]:
    """Every code object of the library's functions and methods in ``modules`` (nested ones included), with the
    path of the function it belongs to. Code objects compare equal whatever their file name."""
    found: dict[types.CodeType, str] = {}
    todo = [v for m in sorted(modules) for v in vars(sys.modules[m]).values()]
    seen: set[int] = set()
    while todo:
        obj = function_of(todo.pop())
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        path = library_path(obj)
        if isinstance(obj, types.FunctionType) and path:
            for code in _nested_codes(obj.__code__):
                found.setdefault(code, path)
        elif isinstance(obj, type) and path:
            todo += list(vars(obj).values())
    return found


def library_codes() -> dict[types.CodeType, str]:
    """Every code object of the loaded library's functions, with the path of the function it belongs to."""
    return _library_codes_of(frozenset(m for m in list(sys.modules) if in_library(m)))


# ----------------------------------------------------------------------------------------------------------------
# Reading the answer's code


_MISSING = object()
_NULL = object()  # what CALL finds below a callable that is not a method


@dataclass(frozen=True)
class Ref:
    """A value the reading knows: how the code spells it, the object, and the class it was read from (a method
    that a permitted class offers is permitted, wherever along its library bases it is defined)."""

    spelled: str
    obj: Any
    owner: type | None = None


@dataclass(frozen=True)
class _Instance:
    """What calling a class gives: its attributes are looked up on the class."""

    cls: type


@dataclass(frozen=True)
class _Super:
    """``super()`` inside a method of ``cls``."""

    cls: type


def _safe_getattr(obj: Any, name: str) -> Any:
    """An attribute without running the learner's or the library's code (no property, no ``__getattr__`` of an
    instance): modules, classes and constants read directly, instances through their class."""
    try:
        if isinstance(obj, _Instance):
            return function_of(inspect.getattr_static(obj.cls, name))
        if isinstance(obj, _Super):
            for cls in obj.cls.__mro__[1:]:
                if name in vars(cls):
                    return function_of(vars(cls)[name])
            return _MISSING
        if isinstance(obj, types.ModuleType | type | str | bytes | tuple | dict | int | float):
            return getattr(obj, name)
        return function_of(inspect.getattr_static(type(obj), name))
    except Exception:  # a lazy module attribute, a missing one
        return _MISSING


def _constant(ref: Any) -> Any:
    """The value of a ref holding a string or a tuple/list of strings, else _MISSING."""
    if isinstance(ref, Ref) and (isinstance(ref.obj, str) or (isinstance(ref.obj, tuple | list)
                                                             and all(isinstance(x, str) for x in ref.obj))):
        return ref.obj
    return _MISSING


def _import(name: Any) -> Any:
    """A module named by a constant string: imported only when it is the library's or already loaded."""
    if not isinstance(name, str):
        return _MISSING
    if name in sys.modules:
        return sys.modules[name]
    if in_library(name):
        try:
            return importlib.import_module(name)
        except Exception:  # a misspelt module
            return _MISSING
    return _MISSING


_PURE = {str.join, str.format, str.replace, str.strip, str.lower, str.upper, str.removeprefix, str.removesuffix,
         str.__add__, str.__mod__, str.lstrip, str.rstrip}
"""String methods the reading evaluates on constants (to see a module name built by joining or formatting)."""


class Reader:
    """Walks an answer: ``refs`` yields every value its code loads (and the ``Reader`` then follows the learner's
    own functions and classes among them); ``escaped`` collects modules used for more than an attribute."""

    def __init__(self) -> None:
        self.escaped: list[Ref] = []
        self.data: list[tuple[str, dict[str, Any]]] = []
        """(name, globals) of each global holding data (not code) that the code reads: what computed it is read
        too (``computed_by``), so a table filled with the library's results at a cell's top level is seen."""

    def refs(self, fn: types.FunctionType) -> Iterator[Ref]:
        cells: dict[str, Any] = {}
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                cells[name] = Ref(name, cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        yield from self.code_refs(fn.__code__, fn.__globals__, cells)

    def code_refs(self, code: types.CodeType, globals_: dict[str, Any], cells: dict[str, Any]) -> Iterator[Ref]:
        """What ``code`` (and the code nested in it) loads, read with ``globals_`` and closure ``cells``."""
        stack: list[Any] = []
        local: dict[str, Any] = {}
        saved: dict[int, list[Any]] = {}  # the stack a forward jump leaves for its target
        kwnames: tuple[str, ...] = ()
        cls = cells.get("__class__")
        after_jump = False

        def pop(n: int = 1) -> list[Any]:
            got = [stack.pop() if stack else None for _ in range(n)]
            return got[::-1]

        for ins in dis.get_instructions(code):
            if ins.is_jump_target and ins.offset in saved:
                if after_jump or not stack:
                    stack[:] = saved[ins.offset]
            elif after_jump:
                stack.clear()
            after_jump = False
            op, arg, val = ins.opname, ins.arg, ins.argval
            new: Any = None
            if op == "LOAD_CONST":
                new = Ref(repr(val), val)
            elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
                if op == "LOAD_GLOBAL" and arg is not None and arg & 1:
                    stack.append(_NULL)
                found = globals_.get(val, getattr(builtins, val, _MISSING))
                new = Ref(val, found) if found is not _MISSING else None
                if val in globals_ and not callable(found) and not isinstance(found, types.ModuleType):
                    self.data.append((val, globals_))
            elif op == "LOAD_FAST":
                new = local.get(val)
            elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
                new = local.get(val, cells.get(val))
            elif op in ("LOAD_ATTR", "LOAD_METHOD"):
                (owner,) = pop()
                new = self._attribute(owner, val)
                if op == "LOAD_METHOD":
                    method_of_instance = isinstance(owner, Ref) and not isinstance(
                        owner.obj, types.ModuleType | type | str | dict | _Super)
                    if method_of_instance:
                        stack.append(new)
                        yield from self._produced(new)
                        new = owner
                    else:
                        stack.append(_NULL)
            elif op == "IMPORT_NAME":
                _level, fromlist = pop(2)
                module = _import(val)
                if module is not _MISSING and not (isinstance(fromlist, Ref) and fromlist.obj):
                    top = val.split(".")[0]
                    new = Ref(top, sys.modules.get(top, _MISSING))
                elif module is not _MISSING:
                    new = Ref(val, module)
            elif op == "IMPORT_FROM":
                owner = stack[-1] if stack else None
                new = self._attribute(owner, val)
                if isinstance(owner, Ref) and isinstance(owner.obj, types.ModuleType) and (
                        new is None or new.obj is _MISSING):
                    new = Ref(f"{owner.spelled}.{val}", _import(f"{owner.obj.__name__}.{val}"))
            elif op in ("PRECALL", "NOP", "RESUME", "CACHE", "EXTENDED_ARG", "COPY_FREE_VARS", "MAKE_CELL"):
                continue
            elif op == "KW_NAMES":
                kwnames = val if isinstance(val, tuple) else code.co_consts[arg]
                continue
            elif op == "CALL":
                args = pop(arg)
                below, callee = pop(2)
                if below is not _NULL:
                    callee, args = below, [callee, *args]
                positional = args[:len(args) - len(kwnames)]
                new = self._call(callee, positional, cls)
                kwnames = ()
            elif op == "STORE_FAST" or op == "STORE_DEREF":
                (local[val],) = pop()
                continue
            elif op == "BINARY_OP":
                left, right = pop(2)
                a, b = _constant(left), _constant(right)
                if a is not _MISSING and b is not _MISSING and ins.argrepr.rstrip("=") in ("+", "%"):
                    try:
                        value = a + b if ins.argrepr.startswith("+") else a % b
                        new = Ref(repr(value), value)
                    except TypeError:
                        new = None
            elif op == "BINARY_SUBSCR":
                container, key = pop(2)
                if isinstance(container, Ref) and isinstance(container.obj, dict) and _constant(key) is not _MISSING:
                    found = container.obj.get(key.obj, _MISSING)
                    new = Ref(f"{container.spelled}[{key.obj!r}]", found) if found is not _MISSING else None
            elif op == "FORMAT_VALUE":
                if (arg or 0) & 0x04:
                    pop()
                (value,) = pop()
                if isinstance(value, Ref) and isinstance(value.obj, str | int) and not (arg or 0) & 0x03:
                    new = Ref(repr(str(value.obj)), str(value.obj))
            elif op in ("BUILD_STRING", "BUILD_TUPLE", "BUILD_LIST"):
                parts = pop(arg)
                if all(_constant(p) is not _MISSING or (isinstance(p, Ref) and isinstance(p.obj, str))
                       for p in parts):
                    value = "".join(p.obj for p in parts) if op == "BUILD_STRING" else tuple(p.obj for p in parts)
                    new = Ref(repr(value), value)
            elif op in ("LIST_EXTEND", "LIST_APPEND"):  # ["a", "b", "c"] is BUILD_LIST 0, then LIST_EXTEND
                (value,) = pop()
                if len(stack) >= arg:
                    into, more = _constant(stack[-arg]), _constant(value)
                    joined = (*into, *(more if op == "LIST_EXTEND" else (more,))) if isinstance(into, tuple) and \
                        more is not _MISSING else None
                    stack[-arg] = None if joined is None else Ref(repr(joined), joined)
                continue
            elif op == "COPY":
                new = stack[-arg] if len(stack) >= arg else None
            elif op == "SWAP":
                if len(stack) >= arg:
                    stack[-1], stack[-arg] = stack[-arg], stack[-1]
                continue
            else:
                effect = dis.stack_effect(ins.opcode, arg if ins.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
                if ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
                    jump_effect = dis.stack_effect(ins.opcode, arg, jump=True)
                    target = val if isinstance(val, int) else None
                    if target is not None and target > ins.offset:
                        snapshot = list(stack)
                        del snapshot[len(snapshot) + min(jump_effect, 0):]
                        saved.setdefault(target, snapshot)
                    after_jump = op.startswith(("JUMP_FORWARD", "JUMP_BACKWARD"))
                after_jump = after_jump or op in ("RETURN_VALUE", "RAISE_VARARGS", "RERAISE")
                if effect < 0:
                    pop(-effect)
                elif effect > 0:
                    stack.extend([None] * effect)
                elif stack:
                    stack[-1] = None
                continue
            stack.append(new)
            yield from self._produced(new)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                inner = {name: local.get(name, cells.get(name)) for name in const.co_freevars}
                yield from self.code_refs(const, globals_, {k: v for k, v in inner.items() if v is not None})

    def _produced(self, ref: Any) -> Iterator[Ref]:
        if isinstance(ref, Ref) and ref.obj is not _MISSING and not isinstance(ref.obj, types.ModuleType):
            yield ref

    def _attribute(self, owner: Any, name: str) -> Ref | None:
        if not isinstance(owner, Ref):
            return None
        if isinstance(owner.obj, types.ModuleType) and name.startswith("__"):
            self.escaped.append(owner)  # __dict__, __getattribute__: the whole module
        value = _safe_getattr(owner.obj, name)
        if value is _MISSING:
            return None
        obj = owner.obj
        cls = obj if isinstance(obj, type) else obj.cls if isinstance(obj, _Instance | _Super) else \
            None if isinstance(obj, types.ModuleType) else type(obj)
        return Ref(f"{owner.spelled}.{name}", value, cls)

    def _call(self, callee: Any, args: list[Any], cls: Any) -> Ref | None:
        """What a call returns when the reading can tell: an instance of a class, ``super()``, and the resolvers
        (``getattr``, ``vars``, ``importlib.import_module``, ``__import__``, string methods) on constants."""
        if not isinstance(callee, Ref):
            return None
        fn, shown = callee.obj, callee.spelled
        if fn is super:
            return Ref("super()", _Super(cls.obj)) if not args and isinstance(cls, Ref) and isinstance(
                cls.obj, type) else None
        if isinstance(fn, type):
            return Ref(f"{shown}()", _Instance(fn))
        if fn in (getattr, vars, importlib.import_module, builtins.__import__, hasattr, dir):
            return self._resolve(fn, args)
        if isinstance(fn, types.BuiltinMethodType) and isinstance(fn.__self__, str):
            fn, args = getattr(str, fn.__name__, None), [Ref(repr(fn.__self__), fn.__self__), *args]
        if fn in _PURE and all(_constant(a) is not _MISSING for a in args):
            try:
                value = fn(*(a.obj for a in args))
            except Exception:  # a format with a missing field
                return None
            return Ref(repr(value), value)
        for a in args:
            if isinstance(a, Ref) and isinstance(a.obj, types.ModuleType):
                self.escaped.append(a)
        return None

    def _resolve(self, fn: Any, args: list[Any]) -> Ref | None:
        target = args[0] if args else None
        name = _constant(args[1]) if len(args) > 1 else _MISSING
        if fn in (importlib.import_module, builtins.__import__):
            module = _import(_constant(target))
            if module is _MISSING:
                return None
            fromlist = _constant(args[3]) if len(args) > 3 else _MISSING
            if fn is builtins.__import__ and not fromlist:
                top = module.__name__.split(".")[0]
                return Ref(top, sys.modules[top])
            return Ref(f"import_module({module.__name__!r})", module)
        if not isinstance(target, Ref):
            return None
        if fn is getattr and isinstance(name, str):
            return self._attribute(target, name)
        if isinstance(target.obj, types.ModuleType):
            self.escaped.append(target)  # vars(module), dir(module), getattr with a name built at run time
        if fn is vars and isinstance(target.obj, types.ModuleType | type):
            return Ref(f"vars({target.spelled})", dict(vars(target.obj)))
        return None


def _cell_files() -> list[str]:
    """The notebook cells this process ran (IPython keeps their source in ``linecache``; no file on disk)."""
    return [name for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None]


_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "__setitem__"}


def _writes(node: ast.AST, name: str) -> bool:
    """Whether a statement assigns or fills the global ``name``: as a target (``name = ...``, ``name[k] = ...``,
    ``for name in ...``, ``with ... as name``) or through a method that fills it (``name.append(...)``)."""
    def base(target: ast.AST) -> set[str]:
        while isinstance(target, ast.Subscript | ast.Attribute | ast.Starred):
            target = target.value
        if isinstance(target, ast.Tuple | ast.List):
            return {n for t in target.elts for n in base(t)}
        return {target.id} if isinstance(target, ast.Name) else set()

    for sub in ast.walk(node):
        targets: list[ast.AST] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor | ast.NamedExpr):
            targets = [sub.target]
        elif isinstance(sub, ast.With | ast.AsyncWith):
            targets = [i.optional_vars for i in sub.items if i.optional_vars is not None]
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _MUTATORS:
            targets = [sub.func.value]
        if any(name in base(t) for t in targets):
            return True
    return False


def computed_by(name: str, files: list[str]) -> Iterator[types.CodeType]:
    """The code of each top-level statement of ``files`` (source files or notebook cells) that assigns or fills
    ``name``."""
    for filename in files:
        try:
            tree = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):  # a cell with IPython syntax left in it
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _writes(node, name):
                yield compile(ast.Module([node], type_ignores=[]), filename, "exec")


# ----------------------------------------------------------------------------------------------------------------
# The verdict


def _learners_function(obj: Any) -> bool:
    return isinstance(obj, types.FunctionType) and code_kind(obj.__code__.co_filename) == LEARNER_CODE


def _learners_class(obj: Any) -> bool:
    """A class of the learner's: defined in a notebook cell (module ``__main__``) or in a file of theirs."""
    if not isinstance(obj, type) or library_path(obj):
        return False
    name = getattr(obj, "__module__", "") or ""
    file = getattr(sys.modules.get(name), "__file__", None)
    return name == "__main__" or file is None or code_kind(os.path.abspath(file)) == LEARNER_CODE


def _library_methods(cls: type) -> Iterator[tuple[str, Any]]:
    """(path, function) of each library method ``cls`` inherits and does not define itself (nor a class of the
    learner's between them)."""
    seen: set[str] = set()
    for base in cls.__mro__:
        library = library_path(base) is not None
        for name, value in vars(base).items():
            if name in seen:
                continue
            seen.add(name)
            fn = function_of(value)
            if library and isinstance(fn, types.FunctionType):
                yield f"{library_path(base)}.{name}", fn


def static_refusal(answer: Any, allowed: Allowed, name: str = "the answer") -> str | None:
    """Why ``answer`` reaches objects of the library that ``allowed`` does not permit (each of them, in the order
    the reading meets them), or None."""
    reader = Reader()
    seen: set[int] = set()
    todo: deque[Ref] = deque([Ref(name, answer)])
    found: dict[str, str] = {}  # path -> how the answer reaches it
    computed: set[tuple[str, int]] = set()  # the data globals whose computation was read
    learner_files: list[str] = []  # the files of the learner's functions met (modules of their own)

    def refuse(how: str, path: str, spelled: str = "") -> None:
        alias = "" if spelled in ("", path) or path.endswith("." + spelled) else f" (as {spelled})"
        found.setdefault(path, f"{how} {path}{alias}")

    while todo:
        ref = todo.popleft()
        obj = function_of(ref.obj)
        if isinstance(obj, _Instance):
            continue
        if isinstance(obj, functools.partial):
            todo += [Ref(ref.spelled, v) for v in (obj.func, *obj.args, *obj.keywords.values())]
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        path = library_path(obj)
        if path is None and isinstance(obj, types.FunctionType) and \
                code_kind(obj.__code__.co_filename) == LEARNER_CODE:
            path = library_codes().get(obj.__code__)  # the library's code in a function of the learner's
        if path is not None:
            ok = isinstance(obj, types.ModuleType) or (  # a module is judged when it escapes (below)
                allowed.leads_to(path) if isinstance(obj, type) else
                allowed.permits(path) or allowed.offers(ref.owner, obj))
            if not ok:
                refuse("uses", path, ref.spelled)
        elif _learners_class(obj):
            for base in obj.__mro__[1:]:
                base_path = library_path(base)
                if base_path and not allowed.leads_to(base_path):
                    refuse(f"{obj.__name__} subclasses", base_path)
            for method_path, _ in _library_methods(obj):
                if not allowed.permits(method_path):
                    refuse(f"{obj.__name__} inherits", method_path)
            todo += [Ref(f"{obj.__name__}.{k}", v) for k, v in vars(obj).items() if not k.startswith("__")
                     or isinstance(v, types.FunctionType | staticmethod | classmethod | property)]
        elif _learners_function(obj):
            learner_files.append(obj.__code__.co_filename)
            todo += [Ref(f"{ref.spelled} default", v) for v in (obj.__defaults__ or ())]
            todo += [Ref(f"{ref.spelled} default", v) for v in (obj.__kwdefaults__ or {}).values()]
            if hasattr(obj, "__wrapped__"):
                todo.append(Ref(ref.spelled, obj.__wrapped__))
            todo += list(reader.refs(obj))
        elif not isinstance(obj, types.FunctionType | type) and _learners_class(type(obj)):
            todo.append(Ref(f"type({ref.spelled})", type(obj)))  # a callable instance of the learner's class
        for module in reader.escaped:
            module_path = library_path(module.obj)
            if module_path and not allowed.leads_to(module_path):
                refuse("uses the module", module_path, module.spelled)
        reader.escaped.clear()
        for data_name, globals_ in reader.data:
            if (data_name, id(globals_)) not in computed:
                computed.add((data_name, id(globals_)))
                files = [*dict.fromkeys([*learner_files, *_cell_files()])]
                for code in computed_by(data_name, files):
                    todo += [Ref(f"{r.spelled}, in the statement that computes {data_name}", r.obj, r.owner)
                             for r in reader.code_refs(code, globals_, {})]
        reader.data.clear()
    return refusal_message(name, list(found.values()), allowed) if found else None


def refusal_message(name: str, reached: list[str], allowed: Allowed) -> str:
    """The reason a learner reads: what the answer reached and how ("uses X", "calls Y"), and what the exercise
    allows instead."""
    return (f"{name} {'; '.join(reached)}, which this exercise does not allow: write it yourself (its answer may "
            f"use {allowed.describe()})")
