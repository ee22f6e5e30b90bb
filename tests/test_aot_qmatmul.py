"""The integer-weight matmul kernels (kernels_pallas/qmatmul) compiled by the real TPU and NVIDIA GPU compilers,
deviceless (kimi_jax/deploy/aot.py): libtpu's Mosaic for the TPU kernel, XLA:GPU's Triton -> PTX -> cubin for the
GPU kernel, with the automatic choice under the target's mesh.

Shapes are K3's: the shared experts' fused gate / up projection (``[6144, 7168]``, in every MoE layer) and the dense
layer-0 MLP's down projection (``[7168, 33792]``: a long I loop, 33 or more steps), at decode (8 rows) and prefill
(512 rows), bfloat16 activations. The compiled program must hold exactly one Pallas kernel call (the kernel, not
the reference, was compiled), fit the target's HBM, and keep fewer bytes of temporaries than the packed weight
itself: the weight is decoded tile by tile, never into a dense copy (temporaries are the activations split into
even / odd columns and the row padding). The default set compiles int8 and int4 (groups of 32) for v5e and H200,
and the float32 prefill on H200 (the case that once asked Triton for more shared memory than a block may use);
the other formats, the down projection and v6e / H100 are ``-m slow``.
"""

import time

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas.qmatmul as qm
from kernels_pallas import quant
from kimi_jax.deploy import aot
from tests.test_aot import TARGETS
from tests.test_aot_paged import _compile_kernel_and_stats

S = jax.ShapeDtypeStruct
BF, F32 = jnp.bfloat16, jnp.float32

SHAPES = {"shared_up": (6144, 7168), "dense_down": (7168, 33792)}  # (J, I)
FORMATS = {  # name -> (type, fields as (shape, dtype) given J, I)
    "int8": (quant.Int8Weight, lambda J, I: [((J, I), jnp.int8), ((J, 1), F32)]),
    "int4-g32": (quant.Int4Weight, lambda J, I: [((J, I // 2), jnp.uint8), ((J, I // 32), F32)]),
    "int4-g128": (quant.Int4Weight, lambda J, I: [((J, I // 2), jnp.uint8), ((J, I // 128), F32)]),
    "int4-g32-zero": (quant.Int4ZeroWeight, lambda J, I: [((J, I // 2), jnp.uint8), ((J, I // 32), F32),
                                                          ((J, I // 32), jnp.int8)]),
    "nf4-g64": (quant.NF4Weight, lambda J, I: [((J, I // 2), jnp.uint8), ((J, I // 64), F32)]),
}
ROWS = {"decode": 8, "prefill": 512}


def _cases():
    for chip in ("v5e", "h200", "v6e", "h100"):
        for fmt in FORMATS:
            for shape in SHAPES:
                for phase in ROWS:
                    fast = chip in ("v5e", "h200") and fmt in ("int8", "int4-g32") and shape == "shared_up"
                    yield pytest.param(TARGETS[chip], fmt, shape, phase, BF, id=f"{chip}-{fmt}-{shape}-{phase}",
                                       marks=() if fast else pytest.mark.slow)
    for fmt, fast in (("int4-g32", True), ("int8", False)):  # float32 activations: Triton's shared memory
        yield pytest.param(TARGETS["h200"], fmt, "shared_up", "prefill", F32, id=f"h200-{fmt}-shared_up-prefill-f32",
                           marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("target,fmt,shape,phase,dtype", list(_cases()))
def test_qmatmul_compiles(target, fmt, shape, phase, dtype):
    J, I = SHAPES[shape]  # noqa: E741
    kind, field_shapes = FORMATS[fmt]
    fields = [S(s, d) for s, d in field_shapes(J, I)]
    f = lambda x, *fs: qm.matmul(x, kind(*fs))  # noqa: E731
    t0 = time.perf_counter()
    t, compiled = _compile_kernel_and_stats(target, f, [S((ROWS[phase], I), dtype), *fields])
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    assert text.count(t.marker) == 1, f"{fmt}: expected one Pallas kernel ({t.marker}) in the program for {target}"
    m = compiled.memory_analysis()
    packed = sum(s.size * s.dtype.itemsize for s in fields)
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    print(f"{target} {fmt} {shape} {phase} {jnp.dtype(dtype).name}: compiled in {seconds:.1f} s; arguments "
          f"{m.argument_size_in_bytes / 2**20:.1f} MiB, output {m.output_size_in_bytes / 2**20:.1f} MiB, temporaries "
          f"{m.temp_size_in_bytes / 2**20:.2f} MiB")
    assert peak <= aot.hbm_bytes(t), f"{fmt}: {peak} bytes do not fit the {target} HBM"
    assert m.temp_size_in_bytes < packed, \
        f"{fmt}: {m.temp_size_in_bytes} bytes of temporaries, more than the packed weight ({packed}): a dense copy?"


@pytest.mark.parametrize("target", ["tpu:v5e:1x1", "gpu:h200:1x1x1"])
def test_quantized_model_decode_step_runs_the_kernel(target):
    """A whole int8 / int4 model's decode step compiled for one TPU / GPU device: the model's linear layers reach the
    qmatmul kernel through the grouped-product op (kernels_pallas/matvec), one Pallas call per quantized
    projection beyond the float model's kernels, and the compiled step's arguments shrink by the packing."""
    from kimi_jax.checkpoint import synthetic
    from kimi_jax.model import config as C
    from kimi_jax.deploy import aot, plan

    cfg = C.from_dict(synthetic.default_config("llama"))
    mesh = aot.target_mesh(aot.parse_target(target))
    kw = dict(batch=2, context=64, dtype="bfloat16")
    base = plan.compile_step(cfg, mesh, **kw)
    q8 = plan.compile_step(cfg, mesh, quantize="int8", **kw)
    q4 = plan.compile_step(cfg, mesh, quantize="int4:g32", **kw)
    projections = 7 * cfg.num_layers + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
    assert q8["pallas_calls"] - base["pallas_calls"] >= projections, (base, q8)
    assert q4["pallas_calls"] - base["pallas_calls"] >= projections, (base, q4)
    assert q4["argument"] < q8["argument"] < base["argument"]


def test_dense_model_int4_fits_a_10gb_gpu_at_32k():
    """The dense ``KimiForCausalLM`` preset (7B: hidden 4096, 32 layers, 163840 vocab) at batch 1 with a 32K cache,
    compiled whole by XLA:GPU for the smallest GPU it ships a config for (a 1g.10gb MIG slice of an H100: 10.47 GB):
    with int4 weights (groups of 32) the decode step fits, in bfloat16 it does not (its weights alone are 14 GB).
    A 24 GB card holds the int4 model with room to spare (README: the same compile for a 22 GB B200 slice)."""
    from kimi_jax.model import config as C

    cfg = C.preset("kimi-dense")
    target = aot.parse_target("gpu:h100-1g.10gb:1x1x1")
    kw = dict(batch=1, context=32768, dtype="bfloat16", scan_layers=True)
    q4 = aot.compile_steps(cfg, target, {}, quantize="int4", **kw)["decode"]
    bf = aot.compile_steps(cfg, target, {}, **kw)["decode"]
    assert q4["fits"] and q4["peak"] < 10.47e9 and q4["argument"] > 9.5e9, q4  # weights 5.3 GB + cache 4.3 GB
    assert not bf["fits"], bf
    assert bf.get("peak", 0) > 18e9 or bf.get("oom"), bf
