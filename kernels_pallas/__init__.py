"""Kernels for kimi-jax: one small package per op, each a plain-jnp reference (the oracle) plus Pallas kernels and,
where they pay, CPU forms (``xla_cpu.py``: XLA oriented for XLA:CPU; ``native.cc``: C++ kernels built on first use
by ``_native.py``), all behind one entry per op.

``_dispatch.py`` is the one dispatcher: each op's entry chooses the implementation (``implementation=None`` picks
the Pallas kernel on TPU/GPU and the CPU forms that apply on CPU, else the reference; ``"reference"``,
``"pallas"``, ``"pallas_interpret"``, ``"xla_cpu"``, ``"cpu_native"`` ask for one and raise where it cannot run)
and, given a ``Placement`` of several devices, runs it inside ``jax.shard_map`` on the local shard as the op's
partition ``Rule`` declares.

Packages: ``attention`` (causal flash attention for GQA and MLA prefill and decode over a static cache),
``mla_decode`` (absorbed MLA over the latent cache), ``paged_attention`` (absorbed MLA and GQA over a paged cache,
read through its page table), ``sparse_mla`` (Kimi K3.1's DSA attention: absorbed MLA over only the cache
positions chosen per query, their latent rows gathered in the kernel), ``kda`` (chunked prefill, recurrent
decode), ``moe_gmm`` (grouped and gathered expert matmuls, bf16/f32 or MXFP4 decoded in-kernel), ``experts`` (a
layer's routed experts: gather, sorted or dense paths, the expert-parallel exchange on a mesh), ``matvec`` (decode-shaped products,
grouped; float, int8, int4 and NF4 weights on CPU), ``qmatmul`` (int8 / int4 / NF4 weights decoded per tile on TPU
and GPU). The weight formats: ``mxfp4`` and ``quant``, both packed types of ``packed``.
"""

from kernels_pallas._dispatch import KernelUnavailable  # noqa: F401
