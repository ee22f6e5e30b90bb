"""One parity-test template: tolerances by dtype, max-abs and relative-RMS errors, readable failures."""

from __future__ import annotations

import numpy as np

# Max |a - b| allowed, keyed by the dtype the model ran in. Logits are O(1-5) in these tests.
TOL = {
    "float32": 2e-4,
    "bfloat16": 5e-2,
}


def errors(actual, expected) -> tuple[float, float]:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}"
    diff = a - e
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    rel_rms = float(np.sqrt(np.mean(diff**2)) / (np.sqrt(np.mean(e**2)) + 1e-30)) if diff.size else 0.0
    return max_abs, rel_rms


def assert_close(actual, expected, atol: float, what: str = "value"):
    max_abs, rel_rms = errors(actual, expected)
    assert max_abs <= atol, f"{what}: max |diff| {max_abs:.3g} > {atol:.3g} (relative RMS {rel_rms:.3g})"
    return max_abs
