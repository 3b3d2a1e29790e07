"""The import contracts of ``make lint`` cover every module: a new one must take its place.

import-linter checks only the modules a contract names; a module left out of the layers,
or a core module left out of the Django-free list, would be free of both rules.
"""

from __future__ import annotations

import pkgutil
import tomllib
from typing import Any

import django_mongolock
from tests.utils import ROOT

ADAPTERS = 1  # layers[0] is the test harness, layers[1] the Django adapters


def _contracts() -> dict[str, dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def _layers() -> list[set[str]]:
    return [
        {name.strip() for name in layer.split(":")} for layer in _contracts()["layers"]["layers"]
    ]


def _modules() -> set[str]:
    return {info.name for info in pkgutil.iter_modules(django_mongolock.__path__)}


def test_every_module_of_the_package_has_one_layer() -> None:
    layers = _layers()
    placed = [name for layer in layers for name in layer]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    assert set(placed) == _modules()


def test_every_module_below_the_adapters_is_checked_for_django() -> None:
    core = {name for layer in _layers()[ADAPTERS + 1 :] for name in layer}
    contract = _contracts()["django-free-core"]
    checked = {name.removeprefix("django_mongolock.") for name in contract["source_modules"]}
    assert checked == core - {"signals"}  # Django's dispatch: the one ignored import
    assert contract["ignore_imports"] == ["django_mongolock.signals -> django"]
