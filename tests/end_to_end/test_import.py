"""``import torchinstruments`` stays cheap: it loads neither the compiler stack
(``torch._dynamo``, ``torch._inductor``) nor an optional dependency, and our hooks are
still hidden from ``torch.compile`` when Dynamo is imported after injection.

Each check runs in a fresh interpreter, since this test process has long loaded Dynamo.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

OPTIONAL = ("matplotlib", "tensorboard", "lightning", "transformers", "accelerate", "wandb")


def run_python(code: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


def test_import_and_eager_training_load_no_compiler_and_no_optional_package() -> None:
    result = json.loads(
        run_python(
            """
            import json, sys, tempfile
            import torch
            from torch import nn
            before = set(sys.modules)
            import torchinstruments
            from torchinstruments import inject_observer, remove_observer, TensorBoardSink
            imported = sorted(set(sys.modules) - before)

            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            inject_observer(model, output_dir=tempfile.mkdtemp(), sampling=1)
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
            remove_observer(model)
            compiler = [m for m in sys.modules if m.startswith(("torch._dynamo", "torch._ind"))]
            print(json.dumps({"imported": imported, "compiler": sorted(compiler)}))
            """
        )
    )
    foreign = [
        name
        for name in result["imported"]
        if name.split(".")[0] not in sys.stdlib_module_names
        and name.split(".")[0] != "torchinstruments"
    ]
    assert foreign == []
    assert not [name for name in result["imported"] if name.split(".")[0] in OPTIONAL]
    assert result["compiler"] == []  # not at import, not while training eagerly


def test_hooks_are_traced_into_the_graph_when_dynamo_is_imported_after_injection() -> None:
    """Injected before Dynamo is loaded, then compiled: the capture inside compiled graphs
    is ready once Dynamo loads (no graph break: submodule hooks are traced, the root's
    run eagerly), the gradient hooks stay ``torch.compiler.disable``d, and every forward
    is observed."""
    out = run_python(
        """
        import json, sys, tempfile
        import torch
        from torch import nn
        from torchinstruments import inject_observer, remove_observer
        from torchinstruments.capture import ForwardHook, GradHook, NodeGradHook

        class Net(nn.Module):  # torch.compile traces a torch.nn root's hooks inline
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

            def forward(self, x):
                return self.body(x)

        torch.manual_seed(0)
        model = Net()
        folder = tempfile.mkdtemp()
        inject_observer(model, output_dir=folder, sampling=1)
        assert "torch._dynamo" not in sys.modules
        compiled = torch.compile(model, backend="eager")
        for _ in range(5):
            compiled(torch.randn(3, 4)).sum().backward()
        remove_observer(model)
        from torch._dynamo.utils import counters
        report = json.load(open(f"{folder}/report.json"))
        print(json.dumps({
            "disabled": [
                bool(getattr(hook.__call__, "_torchdynamo_disable", False))
                for hook in (ForwardHook, GradHook, NodeGradHook)
            ],
            "breaks": sum(counters["graph_break"].values()),
            "errors": report["coverage"]["errors_total"],
            "samples": report["run"]["samples_seen"],
            "mode": report["coverage"]["compiled_capture"]["mode"],
        }))
        """
    )
    result = json.loads(out.splitlines()[-1])
    assert result["disabled"] == [False, True, True]
    assert result["breaks"] == 0
    assert result["errors"] == 0
    assert result["samples"] == 5
    assert result["mode"] == "in_graph"


def test_without_assume_constant_result_hooks_are_graph_breaks_and_coverage_says_so() -> None:
    """On a torch without ``torch.compiler.assume_constant_result`` (removed here) the
    forward hooks stay ``torch.compiler.disable``d: each observed module call is a graph
    break, every forward is still observed eagerly, and ``coverage.compiled_capture``
    says why."""
    out = run_python(
        """
        import json, tempfile
        import torch
        del torch.compiler.assume_constant_result
        from torch import nn
        from torchinstruments import inject_observer, remove_observer
        from torchinstruments.capture import ForwardHook

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

            def forward(self, x):
                return self.body(x)

        torch.manual_seed(0)
        model = Net()
        folder = tempfile.mkdtemp()
        inject_observer(model, output_dir=folder, sampling=1)
        compiled = torch.compile(model, backend="eager")
        for _ in range(3):
            compiled(torch.randn(3, 4)).sum().backward()
        remove_observer(model)
        from torch._dynamo.utils import counters
        report = json.load(open(f"{folder}/report.json"))
        series = json.load(open(f"{folder}/series.json"))["series"]
        print(json.dumps({
            "disabled": bool(getattr(ForwardHook.__call__, "_torchdynamo_disable", False)),
            "breaks": sum(counters["graph_break"].values()),
            "errors": report["coverage"]["errors_total"],
            "capture": report["coverage"]["compiled_capture"],
            "counts": sorted(
                {(e["module"], e["signal"], e["count"]) for e in series if e["metric"] == "rms"}
            ),
        }))
        """
    )
    result = json.loads(out.splitlines()[-1])
    assert result["disabled"] is True
    assert result["breaks"] >= 3  # one per observed module call at least
    assert result["errors"] == 0
    assert result["capture"]["mode"] == "off: torch without torch.compiler.assume_constant_result"
    assert result["capture"]["slots"] == 0
    modules = ("<root>", "body.0", "body.1", "body.2")
    assert result["counts"] == sorted(
        [m, signal, 3] for m in modules for signal in ("activation", "grad_output")
    )
