"""The KDA recurrence as a native XLA:CPU kernel (``native.cc``): decode steps, and prefill when the recurrence is
the chosen form (``chunk_size=1``, the CPU default). Same contract as
:func:`kernels_pallas.kda.reference.kda_recurrent`; inputs are cast to float32 as there."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import _native
from kernels_pallas._common import acc_dtype
from kernels_pallas.kda.reference import _zeros_state

KERNEL = _native.Kernel(Path(__file__).with_name("native.cc"))
SYMBOL = "KimiKdaRecurrentF32"
_F32 = jnp.float32


def unsupported(q, k, v, g, beta, state, **_) -> str | None:
    """Why the kernel cannot take these operands (float64 ones: it computes in float32), or None."""
    if acc_dtype(q, k, v, g, beta, state) != _F32:
        return "float64 operands (the native kernel computes in float32; the reference follows float64)"
    return None


def kda_recurrent(q_BTHK, k_BTHK, v_BTHU, g_BTHK, beta_BTH, state_BHKU=None, *, scale):
    """Returns (o_BTHU float32, final state_BHKU float32); the state is updated in place when XLA can alias it.
    Raises :class:`~kernels_pallas._native.NativeUnavailable` when the kernel cannot be built."""
    target = KERNEL.target(SYMBOL)
    q, k, v, g, beta = (x.astype(_F32) for x in (q_BTHK, k_BTHK, v_BTHU, g_BTHK, beta_BTH))
    state = _zeros_state(q, v) if state_BHKU is None else state_BHKU.astype(_F32)
    # the decay and the k.q products as the reference's kda_step computes them (XLA vectorises the exp)
    a, kq = jnp.exp(g), jnp.sum(k * (q * scale), axis=-1)
    out = (jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(state.shape, _F32))
    return tuple(jax.ffi.ffi_call(target, out, input_output_aliases={6: 1})(
        q, k, v, a, beta, kq, state, scale=np.float32(scale)))
