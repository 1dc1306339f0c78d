"""The layers import downwards only: the folder a module is in says what it may use."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "renqueue"

#: What each part of renqueue must not import (at run time; type-only imports
#: under ``if TYPE_CHECKING:`` do not count). A part is a subpackage or a
#: top-level module, named as in ``renqueue/``.
FORBIDDEN = {
    "wire": {"policy", "state", "services", "ops", "tools", "backends", "_client", "config"},
    "policy": {"state", "services", "ops", "tools", "backends", "_client"},
    "state": {"services", "ops", "tools", "backends", "_client"},
    "ops": {"state", "services", "tools", "backends", "_client"},
    "backends": {"state", "services", "ops", "tools", "_client"},
    "services": {"tools", "_client", "cli", "gateway"},
    "_client": {"state", "services", "tools", "backends", "metrics", "gateway"},
    "config": {"wire", "state", "services", "ops", "tools", "backends", "_client"},
    # The what-if simulation: the policy, the fold and the wire, never a service.
    "sim": {"services", "ops", "tools", "backends", "_client", "cli", "gateway"},
    # The gateway is a client of the queue (it submits through Client) in front of
    # the services; it never calls a backend, nor the tools.
    "gateway": {"tools", "backends", "cli"},
}


def part_of(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def runtime_imports(path: Path) -> set[str]:
    """The renqueue parts ``path`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    module = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = module[:-1]  # a module's package; an __init__'s is its own
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
            else:
                target = (node.module or "").split(".")
            if target[0] == "renqueue":
                if len(target) > 1:
                    found.add(target[1])
                else:
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "renqueue" and len(parts) > 1:
                    found.add(parts[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


MODULES = sorted(
    path for path in PACKAGE.rglob("*.py") if part_of(path) in FORBIDDEN or path.stem in FORBIDDEN
)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_a_module_imports_no_layer_above_its_own(path: Path) -> None:
    part = part_of(path)
    assert not runtime_imports(path) & FORBIDDEN[part]


def test_the_check_sees_the_imports_it_is_about() -> None:
    """A router imports the state it reads: the check would catch the reverse."""
    assert {"state", "wire", "policy"} <= runtime_imports(
        PACKAGE / "services" / "router" / "_router.py"
    )
    assert "state" in runtime_imports(PACKAGE / "services" / "worker" / "_worker.py")
