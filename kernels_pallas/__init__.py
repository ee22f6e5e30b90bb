"""Kernels for kimi-jax: one small package per op, each a plain-jnp reference (the oracle and the CPU path)
plus Pallas kernels behind the same signature, chosen with ``implementation=``:

* ``None`` (automatic): the reference on CPU, the Pallas kernel on TPU/GPU;
* ``"reference"``: the plain-jnp oracle anywhere;
* ``"pallas"``: the compiled kernel (Triton on GPU, Mosaic on TPU); on CPU this raises :class:`KernelUnavailable`;
* ``"pallas_interpret"``: the same kernel source run by Pallas's interpreter on any backend (how CPU tests run it).

Packages: ``attention`` (causal flash attention for GQA and MLA prefill and decode over a static cache),
``mla_decode`` (absorbed MLA over the latent cache), ``kda`` (chunked prefill, recurrent decode), ``moe_gmm``
(grouped and gathered expert matmuls, bf16/f32 or MXFP4 decoded in-kernel).

For decode on XLA:CPU, ``matvec`` runs several few-row float32 products (plain weights or chosen experts read in
place) as one C++ kernel call (``implementation="cpu_native"``, the automatic choice there; ``_native.py`` builds
it on first use); the gathered expert matmul takes it too.
"""

from kernels_pallas._dispatch import KernelUnavailable, resolve  # noqa: F401
