"""The house's layout holds: each folder is pure or I/O, as its name says, the
layers import downwards only, and packages are entered by their front.

docs/architecture.md has the map this test enforces.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "renqueue"

#: Pure parts: plain data and functions of (state, input). No NATS, no HTTP,
#: no clock, no task; none of the I/O parts below.
PURE = {"errors", "text", "schema", "policy", "state", "sim", "config"}

#: Modules from outside renqueue a pure part must not import.
IO_MODULES = {
    "asyncio",
    "time",
    "socket",
    "subprocess",
    "threading",
    "nats",
    "httpx",
    "aiohttp",
    "structlog",
    "logging",
    "prometheus_client",
}

#: What each part may import of renqueue, at run time (type-only imports under
#: ``if TYPE_CHECKING:`` do not count). A part is a subpackage or a top-level
#: module, named as in ``renqueue/``.
ALLOWED = {
    # pure
    "errors": set(),
    "text": set(),
    "schema": {"errors"},
    "policy": {"errors", "schema"},
    "config": {"errors", "schema", "policy"},
    "state": {"errors", "schema", "policy", "config"},
    "sim": {"errors", "schema", "policy", "config", "state"},
    # observability
    "logs": {"metrics"},
    "metrics": set(),
    # I/O
    "tasks": {"errors", "logs"},
    "lifecycle": {"errors", "logs", "tasks"},
    "broker": {"errors", "schema", "policy", "config", "logs", "metrics", "tasks", "lifecycle"},
    "coordination": {
        "errors",
        "schema",
        "policy",
        "config",
        "state",
        "sim",
        "logs",
        "metrics",
        "tasks",
        "lifecycle",
        "broker",
    },
    "backends": {"errors", "schema", "policy", "config", "logs", "metrics", "tasks", "lifecycle"},
    "client": {"errors", "schema", "config", "logs", "tasks", "lifecycle", "broker"},
    "services": {
        "errors",
        "schema",
        "policy",
        "config",
        "state",
        "logs",
        "metrics",
        "tasks",
        "lifecycle",
        "broker",
        "coordination",
        "backends",
    },
    # The gateway is a client of the queue (it submits through Client) in front
    # of the services; it never calls a backend, and the process it runs in is
    # assembled elsewhere (``process``).
    "gateway": {
        "errors",
        "schema",
        "policy",
        "config",
        "logs",
        "metrics",
        "tasks",
        "lifecycle",
        "broker",
        "coordination",
        "client",
    },
    "process": {"config", "services", "gateway"},
    "mock": {"errors", "schema", "logs", "lifecycle", "backends"},
    # A real model server in a venv of its own (issue #32): a process, not a part of the queue.
    "llamacpp": {"errors", "lifecycle"},
}

#: Pure leaves every part may import: the errors and text for people.
BASE = {"errors", "text"}

#: Entry points that assemble everything: they may import any part.
TOP = {"cli", "demo", "__main__", "__init__"}


def part_of(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def module_of(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(path: Path) -> list[tuple[tuple[str, ...], bool]]:
    """Every module ``path`` imports, absolute, each with whether it is at run time."""
    return imports_of(path.read_text(), module_of(path), package=path.name == "__init__.py")


def imports_of(
    source: str, module: tuple[str, ...], *, package: bool = False
) -> list[tuple[tuple[str, ...], bool]]:
    tree = ast.parse(source)
    package_of = module if package else module[:-1]
    found: list[tuple[tuple[str, ...], bool]] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of[: len(package_of) - node.level + 1]
                target = (*base, *(node.module.split(".") if node.module else []))
            else:
                target = tuple((node.module or "").split("."))
            if target == ("renqueue",):
                found.extend(((*target, alias.name), runtime) for alias in node.names)
            else:
                found.append((target, runtime))
                # ``from ..broker import _nats``: the private module is a name here.
                found.extend(
                    ((*target, alias.name), runtime)
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                )
        elif isinstance(node, ast.Import):
            found.extend((tuple(alias.name.split(".")), runtime) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, runtime)

    visit(tree, True)
    return found


def runtime_imports(path: Path) -> set[str]:
    """The renqueue parts ``path`` imports at run time."""
    return {
        target[1]
        for target, runtime in imports(path)
        if runtime and target[0] == "renqueue" and len(target) > 1
    }


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


MODULES = sorted(path for path in PACKAGE.rglob("*.py") if "_streams" not in path.parts)
LAYERED = [path for path in MODULES if part_of(path) not in TOP]


def test_every_part_has_a_place_in_the_layout() -> None:
    parts = {part_of(path) for path in MODULES}
    assert parts - TOP <= set(ALLOWED), "a new part needs its place in ALLOWED"


@pytest.mark.parametrize("path", LAYERED, ids=_name)
def test_a_module_imports_only_the_layers_below_its_own(path: Path) -> None:
    part = part_of(path)
    assert runtime_imports(path) - {part} - BASE <= ALLOWED[part]


@pytest.mark.parametrize("path", [path for path in MODULES if part_of(path) in PURE], ids=_name)
def test_a_pure_module_does_no_io(path: Path) -> None:
    """No NATS, HTTP, clock, task or log, even behind ``if TYPE_CHECKING``."""
    outside = {target[0] for target, _ in imports(path) if target[0] != "renqueue"}
    assert not outside & IO_MODULES


def test_the_pure_parts_import_no_io_part() -> None:
    assert BASE <= PURE
    for part in PURE:
        assert not ALLOWED[part] - PURE, part


#: Cross-package imports of a private module that are allowed: none.
PRIVATE_ALLOWED: set[tuple[str, str]] = set()


def private_reaches(path: Path) -> set[str]:
    """Private modules of another package that ``path`` imports."""
    return reaches_of(imports(path), module_of(path))


def reaches_of(found: list[tuple[tuple[str, ...], bool]], module: tuple[str, ...]) -> set[str]:
    reaches = set()
    for target, _ in found:
        if target[0] != "renqueue":
            continue
        for index, piece in enumerate(target[1:], start=1):
            if piece.startswith("_") and not piece.startswith("__"):
                owner = target[:index]  # the package whose front was passed by
                if module[: len(owner)] != owner:
                    reaches.add(".".join(target))
                break
    return reaches


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_a_package_is_entered_by_its_front(path: Path) -> None:
    reaches = {(str(path.relative_to(PACKAGE)), target) for target in private_reaches(path)}
    assert reaches <= PRIVATE_ALLOWED


def test_the_checks_see_what_they_are_about() -> None:
    """A router imports the state it reads; a private reach would be caught."""
    assert {"coordination", "schema", "policy"} <= runtime_imports(
        PACKAGE / "services" / "router" / "_round.py"
    )
    assert "coordination" in runtime_imports(PACKAGE / "services" / "worker" / "_worker.py")
    assert private_reaches(PACKAGE / "services" / "router" / "_router.py") == set()
    # The reach the check is for: a gateway module naming the broker's insides;
    # the broker's own modules may.
    source = "from ..broker._nats import Connection\nfrom ._server import Gateway\n"
    gateway = ("renqueue", "gateway", "_probe")
    assert reaches_of(imports_of(source, gateway), gateway) == {"renqueue.broker._nats"}
    by_name = "from ..broker import _nats\n"
    assert reaches_of(imports_of(by_name, gateway), gateway) == {"renqueue.broker._nats"}
    broker = ("renqueue", "broker", "_probe")
    assert reaches_of(imports_of("from ._nats import Connection\n", broker), broker) == set()


def event_builds(path: Path) -> list[str]:
    """Calls in ``path`` that build an event by its class (``Failed(...)``)."""
    from renqueue.schema import Event  # noqa: PLC0415

    kinds = {kind.__name__ for kind in Event.__args__}
    return [
        f"{node.func.id} at line {node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in kinds
    ]


#: Where events are built field by field: their one constructor each.
CONSTRUCTORS = {PACKAGE / "schema" / "_runs.py"}


@pytest.mark.parametrize("path", [path for path in MODULES if path not in CONSTRUCTORS], ids=_name)
def test_an_event_is_built_only_by_its_constructor(path: Path) -> None:
    """Router, worker, coalescer and simulator build events through
    ``schema/_runs.py``, so an event's fields are spelled once."""
    assert event_builds(path) == []


def test_the_event_check_sees_a_build() -> None:
    assert event_builds(PACKAGE / "schema" / "_runs.py")
