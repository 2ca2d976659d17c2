"""pyproject.toml: installing the test extra after the base install changes no base package."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _requirements(names: list[str]) -> list[Requirement]:
    return [Requirement(r) for r in names]


def test_base_install_takes_a_python_dateutil_the_test_extra_keeps() -> None:
    # matplotlib (base) accepts python-dateutil 4.x; botocore (test extra: boto3, moto) does
    # not. Unless the base pins the line botocore accepts, `pip install -e .` takes 4.x and
    # `pip install -e '.[test]'` then downgrades it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {canonicalize_name(r.name): r for r in _requirements(project["dependencies"])}
    assert "python-dateutil" in base, "the base dependencies leave python-dateutil unpinned"
    ours = base["python-dateutil"].specifier
    botocore = [
        r
        for r in _requirements(importlib.metadata.requires("botocore") or [])
        if canonicalize_name(r.name) == "python-dateutil"
    ]
    matplotlib = [
        r
        for r in _requirements(importlib.metadata.requires("matplotlib") or [])
        if canonicalize_name(r.name) == "python-dateutil"
    ]
    assert botocore and matplotlib
    releases = ["2.7.0", "2.8.2", "2.9.0.post0", "3.0.0", "4.0.0"]
    allowed = [v for v in releases if ours.contains(v)]
    assert allowed, f"python-dateutil {ours} allows none of {releases}"
    for version in allowed:
        assert all(r.specifier.contains(version) for r in botocore), (version, botocore)
    installed = importlib.metadata.version("python-dateutil")
    assert ours.contains(installed) and all(r.specifier.contains(installed) for r in matplotlib)
