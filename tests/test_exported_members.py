"""The public API is what each package's ``__all__`` says, sorted, and nothing else."""

import importlib
import json
import subprocess
import sys
import types

import pytest

import renqueue

#: renqueue's subpackages: private modules, re-exported by the package.
PACKAGES = [
    "renqueue.gateway",
    "renqueue.broker",
    "renqueue.coordination",
    "renqueue.policy",
    "renqueue.services",
    "renqueue.state",
    "renqueue.mock",
    "renqueue.schema",
    "renqueue.services.router",
    "renqueue.services.worker",
    "renqueue.sim",
]

#: What ``import renqueue`` must not load: the services and what only they need.
SERVICE_SIDE = [
    "renqueue.gateway",
    "aiohttp.web",
    "renqueue.services",
    "renqueue.mock",
    "renqueue.metrics",
    "renqueue.backends",
    "prometheus_client",
    "aiolimiter",
    "httpx",
]


def public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    }


def test_all_is_sorted_and_lists_every_public_name() -> None:
    assert renqueue.__all__ == sorted(renqueue.__all__)
    assert public_names(renqueue) - {"annotations"} == set(renqueue.__all__)


def test_a_lazy_name_is_listed_and_resolves_to_the_object_its_module_holds() -> None:
    from renqueue import Services  # noqa: PLC0415 - the lazy import is what is tested
    from renqueue.services import Services as held  # noqa: PLC0415

    assert "Services" in renqueue.__all__
    assert "Services" in dir(renqueue)
    assert Services is held
    assert renqueue.Services is held


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Router'"):
        _ = renqueue.Router  # type: ignore[attr-defined]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_exports_its_modules_public_names_in_a_sorted_all(package: str) -> None:
    """A package's modules are private; its __all__ (constants, classes,
    functions, each group sorted, as ruff's RUF022 orders it) is the whole of it."""
    module = importlib.import_module(package)

    def group(name: str) -> int:
        return 0 if name.isupper() else 1 if name[0].isupper() else 2

    assert module.__all__ == sorted(module.__all__, key=lambda name: (group(name), name))
    assert public_names(module) == set(module.__all__)


def imported_by(code: str) -> list[str]:
    """The service-side modules loaded after running ``code`` in a fresh interpreter."""
    report = f"print(json.dumps([m for m in {SERVICE_SIDE!r} if sys.modules.get(m)]))"
    check = f"{code}\nimport json, sys\n{report}"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    loaded: list[str] = json.loads(out)
    return loaded


def test_import_renqueue_gives_the_client_api_without_loading_the_services() -> None:
    assert imported_by("import renqueue\nfrom renqueue import Client, load_config, schema") == []


def test_the_client_needs_no_aiohttp() -> None:
    """aiohttp comes with the ``mock`` extra only; nats-py imports it when it is
    installed (its websocket transport), so make it unimportable, as it is in a
    plain ``pip install renqueue``: the client API still imports."""
    blocked = (
        "import sys\nsys.modules['aiohttp'] = None\nimport renqueue\nfrom renqueue import Client"
    )
    assert imported_by(blocked) == []


def test_naming_services_loads_them() -> None:
    assert "renqueue.services" in imported_by("from renqueue import Services")
