"""Every kernel op compiled by the real TPU and NVIDIA GPU compilers, deviceless (kimi_jax/deploy/aot.py), at the
awkward shapes of tests/kernel_shapes.py: latent ranks and head dims of 24, 40 and 72, 1, 3 and 5 heads, KDA head
dims 32 and 48, 3, 5 and 6 experts, int8 / int4 / NF4 weights of such widths.

The cases of one op compile together, as one program (a compile per case would cost a second of fixed overhead
each), with the automatic choice under the target's mesh: the compiled program must hold one Pallas kernel per case
(the kernels, not the references, were compiled), except on GPU for the sizes its kernels refuse by name (a
page of 8 tokens, int4 groups of 48 columns), which the automatic choice runs with the reference. When the program does not compile, each case is compiled alone so
the failure names its shapes. The default set compiles the covering set ``FAST`` for v5e and H200; the cross
product ``SLOW``, and the other chips, are ``-m slow``. (The GPU MLA decode once returned its power-of-two padded
latent, 32 columns for a rank of 24: issue 40.)
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_jax.deploy import aot
from tests import kernel_shapes as ks
from tests.test_aot import TARGETS

FAST_CHIPS = ("v5e", "h200")


def _cases():
    for chip in TARGETS:
        for op in ks.OPS:
            fast = chip in FAST_CHIPS
            yield pytest.param(TARGETS[chip], op, "fast", id=f"{chip}-{op}", marks=() if fast else pytest.mark.slow)
            yield pytest.param(TARGETS[chip], op, "slow", id=f"{chip}-{op}-cross", marks=pytest.mark.slow)


def _compile(target, cases):
    """The compiled text of one program running every case (operands in a bfloat16 model's dtypes) under one
    device of ``target``."""
    mesh = Mesh(aot.device_array(target, (1,)), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    args = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), ks.operands(c, jnp.bfloat16))
            for c in cases]
    f = lambda *args: [c.run(*a) for c, a in zip(cases, args)]  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        return jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.parametrize("target,op,table", list(_cases()))
def test_awkward_shapes_compile(target, op, table):
    cases = [c for c in (ks.FAST if table == "fast" else ks.SLOW) if c.op == op]
    t = aot.parse_target(target)
    try:
        text = _compile(t, cases)
    except Exception:  # noqa: BLE001 -- compiled one by one below, to name the shapes that fail
        failed = []
        for c in cases:
            try:
                _compile(t, [c])
            except Exception as e:  # noqa: BLE001
                failed.append(f"{c.name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        pytest.fail(f"{op} on {target}: " + ("; ".join(failed) or "only the cases together fail to compile"))
    # sizes the GPU kernel cannot block (``Case.gpu``) run the reference there, by the automatic choice's own rule
    kernels = sum(c.gpu or t.platform == "tpu" for c in cases)
    assert text.count(t.marker) == kernels, \
        f"{op} on {target}: {text.count(t.marker)} Pallas kernels ({t.marker}) for {kernels} cases that take one"
