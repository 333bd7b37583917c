"""The distribution: the wheel's contents and metadata, an install with only torch that
trains an observed model, and a README whose links work on the package index.

The wheel is built with ``uv build`` and installed with ``uv pip`` into a throwaway
virtual environment, linking torch from uv's cache (nothing large is downloaded). These
tests are skipped only when ``uv`` itself is not available.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import torch

from tests.harness import REPO

ROOT = REPO
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
UV = shutil.which("uv")
needs_uv = pytest.mark.skipif(UV is None, reason="uv (the build tool) is not installed")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert UV is not None
    out = tmp_path_factory.mktemp("dist")
    completed = subprocess.run(
        [UV, "build", "--wheel", "--out-dir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    (path,) = out.glob("torchinstruments-*.whl")
    return path


@pytest.mark.packaging
@needs_uv
def test_wheel_holds_the_package_and_its_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt"))
    sources = {
        "torchinstruments/" + path.relative_to(ROOT / "src" / "torchinstruments").as_posix()
        for path in (ROOT / "src" / "torchinstruments").rglob("*")
        if path.is_file() and path.suffix in {".py", ".typed"}
    }
    packaged = {name for name in names if not name.startswith("torchinstruments-")}
    assert packaged == sources
    assert {"torchinstruments/py.typed", "torchinstruments/integrations/lightning.py"} <= packaged
    # The core needs only torch; everything else is an extra.
    required = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert required == PYPROJECT["project"]["dependencies"]
    assert [r.split(">=")[0] for r in required] == ["torch"]
    assert set(metadata.get_all("Provides-Extra") or []) >= {
        "lightning",
        "transformers",
        "tensorboard",
        "plots",
    }
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(urls)
    classifiers = set(metadata.get_all("Classifier") or [])
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert metadata["Requires-Python"] == ">=3.11"
    assert b"torchinstruments = torchinstruments.__main__:main" in entry_points


@pytest.mark.packaging
@needs_uv
def test_wheel_installs_with_only_torch_and_observes_training(wheel: Path, tmp_path: Path) -> None:
    assert UV is not None
    venv = tmp_path / "venv"
    environment = {**os.environ, "VIRTUAL_ENV": str(venv)}
    subprocess.run(
        [UV, "venv", "--quiet", "--python", sys.executable, str(venv)],
        check=True,
        timeout=120,
        env=environment,
    )
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    # Symbolic links into uv's cache: torch is not copied, whatever the file systems.
    install = subprocess.run(
        [
            *(UV, "pip", "install", "--quiet", "--link-mode", "symlink"),
            *("--python", str(python), str(wheel), f"torch=={torch_version}"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    script = textwrap.dedent(
        """
        import importlib.metadata as metadata, json, pathlib, sys
        import torch
        from torch import nn
        from torchinstruments import inject_observer, remove_observer

        names = {d.metadata["Name"].lower() for d in metadata.distributions()}
        assert "numpy" not in names and "torchinstruments" in names, sorted(names)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        inject_observer(model, output_dir=sys.argv[1], sampling=1)
        for _ in range(5):
            optimizer.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            optimizer.step()
        remove_observer(model)
        report = json.loads(pathlib.Path(sys.argv[1], "report.json").read_text())
        print(report["run"]["samples_seen"], report["coverage"]["errors_total"])
        """
    )
    run = subprocess.run(
        [str(python), "-c", script, str(tmp_path / "stats")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: the installed package is imported
        # The environment is thrown away: writing bytecode would only cost time.
        env={**environment, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": ""},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["5", "0"]
    assert (tmp_path / "stats" / "index.md").is_file()


def test_readme_links_are_absolute_and_point_at_files_of_the_repository() -> None:
    """The package index shows README.md without the repository: a relative link is dead."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    assert [link for link in links if not link.startswith("https://")] == []
    base = PYPROJECT["project"]["urls"]["Source"] + "/blob/main/"
    for link in links:
        if link.startswith(base):
            path = link[len(base) :].split("#")[0]
            assert (ROOT / path).is_file(), link


def test_readme_install_section_names_every_extra() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install torchinstruments" in section
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        assert f'pip install "torchinstruments[{extra}]"' in section, extra
