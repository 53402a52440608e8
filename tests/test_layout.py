"""The repository's shape: what a user meets after cloning and installing.

- From the root of a clone, after a regular (not editable) install, `from jaxengine import LLM`
  and `python -m jaxengine.server` work: the clone's `jaxengine/` folder shadows the installed
  package there, so its sibling packages must be found from it.
- Product folders hold no laboratory files (probes, notes, versioned results); `lab/` is not
  installed.
- The README is a product page: under 200 lines, and every relative link in it and in `docs/`
  resolves inside the repository.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("jaxengine", "models", "server", "pallas_kernels", "benchmarks")


def _tree_files() -> list[str]:
    """The files a fresh clone holds (tracked plus new, not ignored), or None outside git."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def installed_clone(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of the clone's files, installed (regular install) into a folder of its own; the
    environment that runs Python from the clone's root with that install and no editable hooks."""
    tmp = tmp_path_factory.mktemp("clone")
    clone = tmp / "jaxengine"
    for f in _tree_files():
        if f.split("/")[0] in (*PRODUCT, "pyproject.toml", "README.md"):
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, clone / f)
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(clone)], check=True, capture_output=True)
    # -S below: no site processing, so no .pth file (an editable install's finder) takes part;
    # the dependencies come from this interpreter's site-packages by PYTHONPATH.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), *site.getsitepackages()]))
    return clone, env


def test_imports_from_the_root_of_a_clone(installed_clone) -> None:
    clone, env = installed_clone
    code = ("from jaxengine import LLM\n"
            "import jaxengine.models.llama, jaxengine.server.api_server, jaxengine.pallas_kernels.ragged_paged_attention\n"
            "print(jaxengine.models.llama.__file__); print(jaxengine.server.api_server.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=clone, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    files = r.stdout.split()
    assert len(files) == 2 and all(Path(f).is_relative_to(clone) for f in files), files


def test_server_module_runs_from_the_root_of_a_clone(installed_clone) -> None:
    clone, env = installed_clone
    r = subprocess.run([sys.executable, "-S", "-m", "jaxengine.server", "--help"], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--tensor-parallel-size" in r.stdout


def test_installed_packages_are_the_product_folders() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    assert set(dirs.values()) == set(PRODUCT) and set(cfg["packages"]) == set(dirs)
    assert all(name == "jaxengine" or name.startswith("jaxengine.") for name in dirs)  # no generic top-level names


def test_product_folders_hold_no_lab_files() -> None:
    lab = re.compile(r"(^|/)(probe_[^/]*|NOTES[^/]*|[^/]*_v[0-9]+\.json)$")
    found = [f for f in _tree_files() if f.split("/")[0] in PRODUCT and lab.search(f)]
    assert found == []


def _links(md: Path) -> list[str]:
    text = md.read_text()
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)


def test_readme_is_a_product_page() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) < 200
    assert "$OUT" not in readme.read_text()


@pytest.mark.parametrize("md", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))])
def test_document_links_resolve_inside_the_repository(md: str) -> None:
    path = ROOT / md
    for link in _links(path):
        assert not re.match(r"[a-z]+://", link), f"{md} links outside the repository: {link}"
        target = link.split("#")[0]
        if target:
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{md}: {link} does not resolve"
    assert "/work/" not in path.read_text() and "../shared" not in path.read_text(), f"{md} names a machine path"
