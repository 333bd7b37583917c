"""Same output check: the bytes a fixed set of runs writes, hashed, for two trees.

    uv run python benchmarks/same_output.py                    # hashes of this tree
    uv run python benchmarks/same_output.py --against main     # and of a git ref; compare
    uv run python benchmarks/same_output.py --keep DIR         # keep the files written

Trains a small residual MLP (random data, fixed seeds, one CPU thread) four times:
``healthy`` (seed 0), ``modified`` (seed 0, one block's residual branch scaled by 0.01
halfway), ``nonfinite`` (seed 1, one batch with an infinity at step 120) and ``tiny``
(seed 0, ``max_bytes`` and ``series_summary_max_bytes`` at their 4,096 minimum, with
``details.json``). Each writes ``report.json``, ``index.md`` and ``series.json``. Then
``compare_runs`` (healthy against modified, against nonfinite, and at ``max_bytes`` 4,096),
``merge_rank_reports`` over the four reports as ranks 0 to 3 (default bound and 4,096),
and ``show_directory`` on one run and on the merged directory.

Wall-clock fields (ISO timestamps, ``elapsed_s``, ``telemetry_seconds``) are replaced by
fixed text before hashing; everything else must match byte for byte. ``--against REF``
extracts ``src/`` of ``REF`` with ``git archive`` into a temporary directory, runs this
script there in a subprocess (``PYTHONPATH`` first on the path), and exits 1 when any
hash differs, naming the files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

STEPS = 240
_TIME = re.compile(rb"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?\+00:00")
_SECONDS = re.compile(rb'("(?:elapsed_s|telemetry_seconds)": ?)-?[0-9.eE+-]+')


def _normalised(data: bytes) -> bytes:
    return _SECONDS.sub(rb"\g<1>0", _TIME.sub(b"<time>", data))


def _train(out: Path, name: str, *, seed: int, modify: bool, nonfinite: bool, tiny: bool) -> None:
    import torch
    from torch import nn

    from torchinstruments import DirectorySink, ReportConfig, inject_observer, remove_observer

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 2 * width)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(2 * width, width)
            self.factor = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.factor * self.fc2(self.act(self.fc1(self.norm(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(16, 32)
            self.blocks = nn.ModuleList(Block(32) for _ in range(3))
            self.head = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    torch.manual_seed(seed)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    target = out / name
    if tiny:
        config = ReportConfig(max_bytes=4_096, series_summary_max_bytes=4_096)
        sink = DirectorySink(target, write_full_details=True)
        handle = inject_observer(model, report_config=config, sinks=[sink], write_files=False)
    else:
        handle = inject_observer(model, output_dir=target)
    for step in range(STEPS):
        if modify and step == STEPS // 2:
            block = model.blocks[1]
            assert isinstance(block, Block)
            block.factor = 0.01
        x = torch.randn(32, 16, generator=generator)
        if nonfinite and step == 120:
            x[0, 0] = float("inf")
        y = torch.randint(0, 4, (32,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    del handle
    remove_observer(model)


def _produce(out: Path) -> dict[str, str]:
    """Write every output under ``out``; return relative path -> SHA-256 (normalised)."""
    import torch

    from torchinstruments import compare_runs, merge_rank_reports
    from torchinstruments.errors import ConfigError
    from torchinstruments.show import show_directory

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    runs = {
        "healthy": {"seed": 0, "modify": False, "nonfinite": False, "tiny": False},
        "modified": {"seed": 0, "modify": True, "nonfinite": False, "tiny": False},
        "nonfinite": {"seed": 1, "modify": False, "nonfinite": True, "tiny": False},
        "tiny": {"seed": 0, "modify": False, "nonfinite": False, "tiny": True},
    }
    previous = os.getcwd()
    os.chdir(out)  # relative paths: the files name no temporary directory
    try:
        here = Path(".")
        for name, options in runs.items():
            _train(here, name, **options)
        compare_runs("healthy", "modified", "compare-modified")
        compare_runs("healthy", "nonfinite", "compare-nonfinite")
        compare_runs("healthy", "modified", "compare-small", max_bytes=4_096)
        compare_runs("healthy", "tiny", "compare-tiny")
        for rank, name in enumerate(runs):
            rank_dir = here / "ranks" / f"rank-{rank:03d}"
            rank_dir.mkdir(parents=True)
            shutil.copy(here / name / "report.json", rank_dir / "report.json")
        merge_rank_reports("ranks", output_dir="merged")
        try:
            merge_rank_reports("ranks", output_dir="merged-small", max_bytes=4_096)
        except ConfigError as error:
            Path("merged-small").mkdir()
            Path("merged-small", "error.txt").write_text(str(error))
        Path("show-healthy.txt").write_text(show_directory("healthy"))
        Path("show-merged.txt").write_text(show_directory("merged"))
    finally:
        os.chdir(previous)
    return {
        str(path.relative_to(out)): hashlib.sha256(_normalised(path.read_bytes())).hexdigest()
        for path in sorted(out.rglob("*"))
        if path.is_file()
    }


def _at_ref(ref: str) -> dict[str, str]:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as scratch:
        archive = Path(scratch) / "src.tar"
        subprocess.run(
            ["git", "-C", str(root), "archive", "--output", str(archive), ref, "src"], check=True
        )
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        env = {**os.environ, "PYTHONPATH": str(Path(scratch) / "src")}
        done = subprocess.run(
            [sys.executable, __file__, "--json"], env=env, check=True, capture_output=True
        )
        return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="also hash at this git ref, compare")
    parser.add_argument("--keep", metavar="DIR", help="write the outputs here (kept)")
    parser.add_argument("--json", action="store_true", help="print the hashes as JSON only")
    args = parser.parse_args(argv)
    if args.keep:
        out = Path(args.keep)
        out.mkdir(parents=True, exist_ok=False)
        hashes = _produce(out.resolve())
    else:
        with tempfile.TemporaryDirectory() as scratch:
            hashes = _produce(Path(scratch))
    if args.json:
        import torchinstruments

        print(json.dumps({"_source": str(Path(torchinstruments.__file__).parent), **hashes}))
        return 0
    for name, digest in hashes.items():
        print(f"{digest[:16]}  {name}")
    if not args.against:
        return 0
    other = _at_ref(args.against)
    print(f"{args.against}: torchinstruments from {other.pop('_source')}")
    differing = sorted(
        name for name in hashes.keys() | other.keys() if hashes.get(name) != other.get(name)
    )
    for name in differing:
        print(f"DIFFERS: {name}")
    print(f"{len(hashes)} files, {len(differing)} differ from {args.against}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
