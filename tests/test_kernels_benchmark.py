"""benchmarks/gpu_kernels.py, the script meant to run first time on a Hopper GPU, exercised on this CPU machine:
its exact GPU-sized cases (and block sweeps) lower for CUDA, and its harness -- build, run, check against the
reference, time, report -- works end to end on tiny shapes in interpret mode."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import gpu_kernels  # noqa: E402


def test_gpu_sized_cases_lower_for_cuda(capsys):
    assert gpu_kernels.main(["--lower-only"]) == 0, capsys.readouterr().out


@pytest.mark.slow
def test_gpu_sized_block_sweeps_lower_for_cuda(capsys):
    assert gpu_kernels.main(["--lower-only", "--sweep"]) == 0, capsys.readouterr().out


def test_harness_runs_and_checks_in_interpret_mode(tmp_path):
    out = tmp_path / "bench.json"
    rc = gpu_kernels.main(["--interpret", "--only", "moe_gather_mxfp4", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and [r["case"] for r in rows] == ["moe_gather_mxfp4"]
    for r in rows:
        assert r["ok"] and r["rel_rms"] < 1e-2 and r["kernel_ms"] > 0 and "kernel_GBps" in r


@pytest.mark.slow
def test_every_case_and_sweep_in_interpret_mode():
    assert gpu_kernels.main(["--interpret", "--sweep"]) == 0


def test_refuses_to_benchmark_without_a_gpu():
    with pytest.raises(SystemExit):
        gpu_kernels.main([])


def _top_level_names(path: str) -> set:
    """The names a module defines at its top level (functions, classes, assignments, imports), read without
    importing it."""
    import ast

    names = set()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_the_gpu_scripts_import_names_that_exist():
    """The GPU scripts import other benchmarks' helpers inside functions that run only on a GPU: each name they import
    from a script under benchmarks/ is defined there (gpu_model.py's speculative section imported ``REPEAT_TEXT``
    after benchmarks/speculative.py had made it ``REPEAT_TEXTS``: an error only a GPU session would have met)."""
    import ast

    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    checked = 0
    for script in ("gpu_model.py", "gpu_kernels.py"):
        for node in ast.walk(ast.parse(open(os.path.join(here, script), encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                defined = _top_level_names(os.path.join(here, node.module.split(".", 1)[1] + ".py"))
                missing = [a.name for a in node.names if a.name not in defined]
                assert not missing, (script, node.module, missing)
                checked += 1
    assert checked >= 2  # gpu_model.py imports from benchmarks.speculative and benchmarks.verify_cost at least
