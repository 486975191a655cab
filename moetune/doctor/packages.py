"""The interpreter, the installed moetune and its runtime requirements."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from moetune.doctor.base import Check, Status


def check_python(requires: str | None, version: str | None = None) -> Check:
    """The running interpreter against moetune's ``Requires-Python`` (None: not installed, not judged)."""
    version = version or platform.python_version()
    summary, details = f"{platform.python_implementation()} {version}", (f"interpreter: {sys.executable}",)
    if requires and not SpecifierSet(requires).contains(version, prereleases=True):
        return Check(
            "python",
            Status.FAIL,
            f"{summary} does not satisfy {requires}",
            details,
            fix=f"run moetune with a Python {requires}",
        )
    return Check("python", Status.OK, summary + (f", needs {requires}" if requires else ""), details)


def check_install(imported_version: str | None, location: str, dist_version: str | None) -> Check:
    """The imported moetune package against the installed distribution's metadata.

    ``imported_version`` is ``moetune.__version__`` (None when ``moetune/__init__.py`` did not run);
    ``location`` where the package was imported from; ``dist_version`` the metadata's (None: not installed).
    """
    if dist_version is None:
        return Check(
            "install",
            Status.WARN,
            f"moetune is imported from {location} but not installed as a package",
            fix="install it with `pip install -e .` from the repository root",
        )
    if imported_version is None:
        # a setuptools editable install made before moetune/__init__.py existed maps moetune as a namespace
        # package: the package imports, but its __init__ (public API, version) never runs
        return Check(
            "install",
            Status.FAIL,
            f"moetune from {location} imports as a namespace package: its __init__.py did not run",
            fix="reinstall it: `pip install -e .` from the repository root",
        )
    if imported_version != dist_version:
        return Check(
            "install",
            Status.FAIL,
            f"moetune {imported_version} is imported from {location}, but the "
            f"installed metadata is for {dist_version}",
            fix="reinstall it: `pip install -e .` from the repository root",
        )
    return Check("install", Status.OK, f"moetune {imported_version} from {location}")


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_packages(
    requirements: list[str] | None, version_of: Callable[[str], str | None] = installed_version
) -> Check:
    """moetune's declared runtime requirements against what is installed (optional extras are skipped).

    ``requirements`` are PEP 508 strings as ``importlib.metadata.requires("moetune")`` gives them; None
    means moetune is not installed as a distribution, so they cannot be read.
    """
    if requirements is None:
        return Check(
            "packages",
            Status.WARN,
            "moetune's requirements cannot be read: it is not installed as a package (see install)",
        )
    found, problems, wanted = [], [], []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev tools) or another platform's dependency: not needed to run here
        have = version_of(req.name)
        spec = str(req.specifier) or "any version"
        if have is None:
            problems.append(f"{req.name} is missing (needs {spec})")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} is installed; moetune needs {spec}")
        else:
            found.append(f"{req.name} {have}")
            continue
        wanted.append(f'"{req.name}{req.specifier}"')
    if problems:
        return Check(
            "packages", Status.FAIL, "; ".join(problems), tuple(found), fix=f"pip install {' '.join(wanted)}"
        )
    return Check("packages", Status.OK, ", ".join(found))
