"""Find clock readings compared with a 0 sentinel: "never" said as 0.0.

A machine's monotonic clock (``time.monotonic()``, an event loop's ``time()``,
``time.perf_counter()``) counts from its boot, so right after a boot 0.0 is
"just now", not "long ago": a ``last_read = 0.0`` that means "never read"
makes the first read wait out a whole interval. Say "never" as ``None`` or
``-math.inf``.

The check is a small data flow over one module's syntax tree:

- a *clock reading* is a call of ``time.monotonic``/``monotonic``/
  ``time.perf_counter``, of ``<something named *loop*>.time``, or of anything
  named ``clock``/``_clock`` (a clock a component was given, unless its
  class's ``__init__`` takes ``clock`` with the default ``time.time``: a
  wall clock), and any
  arithmetic, ``min`` or ``max`` over one, or a local name assigned one in the
  same function;
- an attribute is *clock-valued* when ``self.X = <reading>`` or
  ``self.X[key] = <reading>`` appears anywhere in its class;
- a *zero sentinel* is ``self.X = 0`` / ``0.0`` (also negated),
  ``dict.fromkeys(..., 0)``, ``defaultdict(float)``/``defaultdict(int)``,
  ``self.X.get(key, 0)`` or ``self.X or 0.0`` on a clock-valued ``X``, and a
  class field ``X: float = 0.0`` of a class called with ``X=<reading>``.

Wall-clock times (``time.time()``) are not readings here: 0.0 is 1970, truly
long ago. The test module runs this over the package and over snippets that
must and must not be found, so the check stays precise.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

_CLOCK_FUNCTIONS = frozenset({"monotonic", "perf_counter", "monotonic_ns", "perf_counter_ns"})
_CLOCK_NAMES = frozenset({"clock", "_clock"})


@dataclass(frozen=True)
class Sentinel:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _name_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):  # asyncio.get_running_loop().time()
        return _name_of(node.func)
    return None


def _is_clock_call(node: ast.expr, *, wall_clock: bool = False) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = _name_of(func)
    if name in _CLOCK_FUNCTIONS or (name in _CLOCK_NAMES and not wall_clock):
        return True
    if isinstance(func, ast.Attribute) and func.attr == "time":
        owner = _name_of(func.value)
        return owner is not None and "loop" in owner.lower()
    return False


def _is_zero(node: ast.expr | None) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_zero(node.operand)
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 0


def _self_attr(node: ast.expr) -> str | None:
    """``X`` of ``self.X`` (or of ``self.X[key]``)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


class _Function:
    """The local names of one function that hold a clock reading."""

    def __init__(
        self, function: ast.FunctionDef | ast.AsyncFunctionDef, *, wall_clock: bool = False
    ) -> None:
        self.wall_clock = wall_clock
        self.readings: set[str] = set()
        # Assignments in source order, to a fixed point (a name may be assigned
        # from another assigned later in a loop).
        assigns = [n for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.AnnAssign))]
        changed = True
        while changed:
            changed = False
            for node in assigns:
                if node.value is None or not self.is_reading(node.value):
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id not in self.readings:
                        self.readings.add(target.id)
                        changed = True

    def is_reading(self, node: ast.expr) -> bool:
        if _is_clock_call(node, wall_clock=self.wall_clock):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.readings
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            return self.is_reading(node.left) or self.is_reading(node.right)
        if isinstance(node, ast.Call) and _name_of(node.func) in {"min", "max"}:
            return any(self.is_reading(arg) for arg in node.args)
        return False


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _wall_clocked(cls: ast.ClassDef) -> bool:
    """Whether ``cls.__init__`` takes a ``clock`` that defaults to ``time.time``."""
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
            args = item.args
            positional = args.posonlyargs + args.args
            pairs = list(
                zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
            )
            pairs += [
                (a, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                if d is not None
            ]
            for arg, default in pairs:
                if arg.arg == "clock" and ast.unparse(default) == "time.time":
                    return True
    return False


def _zero_fields(tree: ast.Module) -> dict[str, dict[str, int]]:
    """Class name -> its fields declared with a zero default -> their line."""
    fields: dict[str, dict[str, int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and _is_zero(item.value)
            ):
                fields.setdefault(node.name, {})[item.target.id] = item.lineno
    return fields


def _zero_init(node: ast.expr) -> bool:
    """``0``, ``dict.fromkeys(keys, 0)``, ``defaultdict(float)`` or ``defaultdict(int)``."""
    if _is_zero(node):
        return True
    if not isinstance(node, ast.Call):
        return False
    name = _name_of(node.func)
    if name == "fromkeys":
        return len(node.args) == 2 and _is_zero(node.args[1])
    if name == "defaultdict" and node.args:
        return _name_of(node.args[0]) in {"float", "int"}
    return False


def find_in_source(source: str, path: str = "<source>") -> list[Sentinel]:
    """Every zero sentinel of a clock reading in one module's ``source``."""
    tree = ast.parse(source)
    found: list[Sentinel] = []
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    wall = {id(function) for cls in classes if _wall_clocked(cls) for function in _functions(cls)}
    zero_fields = _zero_fields(tree)
    for function in _functions(tree):
        flow = _Function(function, wall_clock=id(function) in wall)
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                fields = zero_fields.get(_name_of(node.func) or "", {})
                for keyword in node.keywords:
                    if keyword.arg in fields and flow.is_reading(keyword.value):
                        found.append(
                            Sentinel(
                                path,
                                fields[keyword.arg],
                                f"field {keyword.arg!r} defaults to 0 but is given a clock"
                                f" reading (line {node.lineno})",
                            )
                        )
    for cls in classes:
        clocked: set[str] = set()
        for function in _functions(cls):
            flow = _Function(function, wall_clock=id(function) in wall)
            for node in ast.walk(function):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if flow.is_reading(node.value):
                        clocked.update(a for t in targets if (a := _self_attr(t)) is not None)
        if not clocked:
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    attr = _self_attr(target)
                    if attr in clocked and _zero_init(node.value):
                        found.append(Sentinel(path, node.lineno, f"self.{attr} starts at 0"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = _self_attr(node.func.value)
                if (
                    attr in clocked
                    and node.func.attr == "get"
                    and len(node.args) == 2
                    and _is_zero(node.args[1])
                ):
                    found.append(Sentinel(path, node.lineno, f"self.{attr}.get(..., 0)"))
            elif (
                isinstance(node, ast.BoolOp)
                and isinstance(node.op, ast.Or)
                and any(_self_attr(v) in clocked for v in node.values[:-1])
                and _is_zero(node.values[-1])
            ):
                found.append(Sentinel(path, node.lineno, "a clock reading `or 0`"))
    return sorted(set(found), key=lambda s: (s.path, s.line))


def find(paths: Iterable[Path], root: Path) -> list[Sentinel]:
    return [
        sentinel
        for path in sorted(paths)
        for sentinel in find_in_source(path.read_text(), str(path.relative_to(root)))
    ]
