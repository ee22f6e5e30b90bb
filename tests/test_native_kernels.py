"""The native CPU kernel (``kernels_pallas/moe_gmm/native.cc``) against float64 numpy, the automatic choice that
picks it, and what happens when it cannot run: turned off, unsupported operands, a compiler that fails."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import kernels_pallas.moe_gmm as moe_api
from kernels_pallas import KernelUnavailable, _native
from kernels_pallas.moe_gmm import native
from kernels_pallas.mxfp4 import MXFP4Weight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = f"kimi_jax_{native.SYMBOL}"
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are for XLA:CPU")


def _case(rng, N, X, K, F, E):
    x = rng.standard_normal((N, X, K)).astype(np.float32)
    w = rng.standard_normal((E, F, K)).astype(np.float32)
    idx = rng.integers(0, E, (N, X)).astype(np.int32)
    return x, w, idx


@pytest.mark.parametrize("N,X,K,F,E", [
    (1, 2, 1024, 256, 16),  # the benchmark model's up projections at batch 1: split over the pool's threads
    (1, 2, 256, 1024, 16),  # its down projection
    (4, 3, 1000, 70, 5),    # K past the last 16 lanes, F past the last 4 rows, experts repeated, threads
    (3, 2, 37, 13, 5),      # small: one thread
    (1, 1, 1, 1, 1),
])
def test_gather_matvec_matches_numpy(N, X, K, F, E):
    rng = np.random.default_rng(N * 1000 + K)
    x, w, idx = _case(rng, N, X, K, F, E)
    got = np.asarray(jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native"))(x, w, idx))
    want = np.einsum("nxk,nxfk->nxf", x.astype(np.float64), w[idx].astype(np.float64))
    assert got.shape == (N, X, F) and got.dtype == np.float32
    scale = np.sqrt(K)  # products of unit normals summed over K
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)


def _lowered(x, w, idx, **kw):
    return jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, **kw)).lower(x, w, idx).as_text()


def test_automatic_choice_on_cpu():
    """Float32 weights on CPU: the native kernel; bfloat16 compute, MXFP4 weights, or implementation='reference':
    the plain-jnp reference. Asking for the native kernel where it cannot run raises."""
    rng = np.random.default_rng(0)
    x, w, idx = _case(rng, 1, 2, 64, 32, 4)
    assert TARGET in _lowered(x, w, idx)
    assert TARGET not in _lowered(x, w, idx, implementation="reference")
    assert TARGET not in _lowered(x, w, idx, compute_dtype=jnp.bfloat16)
    packed = MXFP4Weight(jnp.asarray(rng.integers(0, 256, (4, 32, 32)), jnp.uint8),
                         jnp.asarray(rng.integers(118, 126, (4, 32, 2)), jnp.uint8))
    assert TARGET not in _lowered(x, packed, idx)
    with pytest.raises(KernelUnavailable, match="MXFP4"):
        _lowered(x, packed, idx, implementation="cpu_native")
    with pytest.raises(KernelUnavailable, match="bfloat16"):
        _lowered(x, w, idx, implementation="cpu_native", compute_dtype=jnp.bfloat16)
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=tpu)):
        with pytest.raises(KernelUnavailable, match="runs on CPU only, not on 'tpu'"):
            jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native")).trace(x, w, idx)


def test_turned_off(monkeypatch):
    rng = np.random.default_rng(1)
    x, w, idx = _case(rng, 1, 2, 64, 32, 4)
    monkeypatch.setenv(_native.ENV, "off")
    assert TARGET not in _lowered(x, w, idx)
    with pytest.raises(KernelUnavailable, match="turned off"):
        _lowered(x, w, idx, implementation="cpu_native")


def test_expert_id_out_of_range_is_an_error():
    rng = np.random.default_rng(2)
    x, w, idx = _case(rng, 1, 2, 64, 32, 4)
    idx[0, 1] = 4
    with pytest.raises(Exception, match="expert id out of range"):
        jax.block_until_ready(jax.jit(lambda a, b, c: native.gather_matmul(a, b, c))(x, w, idx))


def test_failed_build_falls_back_with_a_warning_and_raises_when_asked(tmp_path):
    """A compiler that fails (here ``false``) in a fresh cache: the automatic choice logs the failure once and runs
    the reference, with the same numbers; an explicit request raises with the build's message."""
    script = textwrap.dedent("""
        import logging, sys
        import numpy as np, jax
        import kernels_pallas.moe_gmm as moe_api
        from kernels_pallas import KernelUnavailable
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 2, 64)).astype(np.float32)
        w = rng.standard_normal((4, 32, 64)).astype(np.float32)
        idx = np.array([[3, 1]], np.int32)
        f = jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c))
        for _ in range(2):
            assert "kimi_jax_" not in f.lower(x, w, idx).as_text()
            got = np.asarray(f(x, w, idx))
            np.testing.assert_allclose(got, np.einsum("nxk,nxfk->nxf", x, w[idx]), atol=1e-4)
        try:
            jax.jit(lambda a, b, c: moe_api.gather_matmul(a, b, c, implementation="cpu_native")).lower(x, w, idx)
        except KernelUnavailable as e:
            print("RAISED:", str(e).splitlines()[0])
        else:
            print("NOT RAISED")
    """)
    env = dict(os.environ, CXX="false", XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu")
    env.pop(_native.ENV, None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stdout.splitlines() if ln.startswith("WARNING:kernels_pallas._native")]
    assert len(warnings) == 1 and "building native.cc with false failed" in warnings[0], proc.stdout
    assert "using the plain-jnp reference instead" in proc.stdout
    assert "RAISED: building native.cc with false failed" in proc.stdout, proc.stdout
    assert not list(tmp_path.glob("kimi-jax/native/*.so"))
