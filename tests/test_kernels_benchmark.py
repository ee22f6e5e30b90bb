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
