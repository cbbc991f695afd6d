"""cpu-lock.txt installs on every Python the README promises: each pin's Requires-Python admits
the oldest (3.11.0: Debian 12's 3.11.2 among them) and its wheels cover every one, so no pin is
refused and none is built from source. Read offline from cpu-lock-python.txt, which `make lock`
writes from the package index, and checked against the installed packages' own metadata."""

import importlib.metadata
import re

from checkout_copy import ROOT
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tools import bootstrap, lock


def lock_table() -> dict[str, tuple[str, str, str]]:
    """`name -> (version, Requires-Python, wheel Pythons)` from cpu-lock-python.txt."""
    rows = {}
    for line in (ROOT / "cpu-lock-python.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        pin, requires, wheels = (part.strip() for part in line.split("|"))
        name, version = pin.split("==")
        rows[name] = (version, requires, wheels)
    return rows


def readme_pythons() -> tuple[str, str]:
    """The oldest and newest Python the README's start section names."""
    match = re.search(r"`python3` \((3\.\d+) to (3\.\d+)", (ROOT / "README.md").read_text())
    assert match, "the README names no Python range: `python3` (3.11 to 3.14 ...)"
    return match.group(1), match.group(2)


def test_the_readme_pyproject_bootstrap_and_lock_name_the_same_pythons():
    oldest, newest = readme_pythons()
    assert (oldest, newest) == (bootstrap.SUPPORTED_PYTHONS[0], bootstrap.SUPPORTED_PYTHONS[-1])
    assert lock.OLDEST_PYTHON == oldest and lock.NEWER_PYTHONS[-1] == newest
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == f">={oldest}"


def test_the_table_covers_every_pin_of_the_lock_at_its_version():
    pins = lock.pins((ROOT / "cpu-lock.txt").read_text())
    table = {name: row[0] for name, row in lock_table().items()}
    assert table == pins, "cpu-lock-python.txt is stale: regenerate both with `make lock`"


def test_every_pin_admits_the_oldest_python_the_readme_promises():
    oldest, _ = readme_pythons()
    floor = Version(f"{oldest}.0")
    refused = {f"{name}=={version}": requires for name, (version, requires, _) in
               lock_table().items() if requires != "any" and floor not in SpecifierSet(requires)}
    assert not refused, f"these pins refuse Python {floor}: {refused}"


def test_every_binary_pin_has_wheels_for_every_python_the_readme_promises():
    missing = {}
    for name, (version, _, wheels) in lock_table().items():
        if wheels == "any":
            continue
        tags = set(wheels.split())
        lacking = [p for p in bootstrap.SUPPORTED_PYTHONS if f"cp{p.replace('.', '')}" not in tags]
        if lacking:
            missing[f"{name}=={version}"] = lacking
    assert not missing, f"no wheels for these Pythons (pip would build from source): {missing}"


def test_the_table_agrees_with_the_installed_packages_metadata():
    """Where this environment holds a pin at its version (CI installs the whole lock), its own
    Requires-Python is the table's: the table cannot drift from what pip reads."""
    compared = 0
    for name, (version, requires, _) in lock_table().items():
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if canonicalize_name(dist.metadata["Name"]) != canonicalize_name(name) or \
                dist.version.split("+")[0] != version.split("+")[0]:
            continue
        installed = dist.metadata.get("Requires-Python") or "any"
        assert SpecifierSet(installed) == SpecifierSet(requires) if "any" not in \
            (installed, requires) else installed == requires, (name, installed, requires)
        compared += 1
    assert compared >= 20, f"only {compared} pins installed here at the lock's versions"


def test_wheel_pythons_reads_the_tags_pip_matches():
    assert lock.wheel_pythons(["a-1-py3-none-any.whl", "a-1.tar.gz"]) == "any"
    assert lock.wheel_pythons(["t-2-cp311-cp311-manylinux_2_28_x86_64.whl",
                               "t-2-cp312-cp312-manylinux_2_28_x86_64.whl"]) == "cp311 cp312"
    assert lock.wheel_pythons(["z-1-cp311-abi3-manylinux_2_28_x86_64.whl"]) == "any"
    assert lock.wheel_pythons(["s-1.tar.gz"]) == "sdist only"
