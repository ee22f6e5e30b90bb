"""One dispatcher for every kernel op: which implementation runs, and where on the mesh it runs.

Each op package declares one :class:`Op` (its implementations, its partition :class:`Rule`, and, where it has one,
when its native CPU kernel applies); calling the op is its public entry. A call does two things:

1. **Chooses the implementation** (:meth:`Op.choose`). Names:

   * ``None`` (automatic): on TPU/GPU the Pallas kernel; on CPU the op's CPU implementations (a native C++
     kernel, an XLA:CPU-tuned form) where they apply to these operands and were measured faster, and the native
     kernel builds (``kernels_pallas/_native.py``); else the reference. When the automatic choice passes over a
     kernel for its operands it logs why (once per op and reason).
   * ``"reference"``: the plain-jnp oracle (``reference.py``); runs anywhere.
   * ``"pallas"``: the Pallas kernel compiled for the target (Triton on GPU, Mosaic on TPU); on CPU it raises.
   * ``"pallas_interpret"``: the same kernel source run by Pallas's interpreter (``interpret=True``) with the GPU
     (Triton) block choices: how CPU tests run kernel code, sharded runs included.
   * ``"cpu_native"``: the C++ kernel for XLA:CPU (ops that have one); anywhere else, or for operands it does not
     take, it raises.
   * ``"xla_cpu"``: plain XLA written in the form XLA:CPU runs fastest (ops that have one; ``xla_cpu.py`` beside
     the reference), e.g. few-row products as ``(W x^T)^T``. Same rules as ``"cpu_native"``.
   * op-specific extras (``kda_prefill`` also takes ``"recurrent"``), and plain-XLA forms any platform may run
     (``Op(forms=...)``: the DSA selection's ``"streaming"``, which the automatic choice takes for long contexts).

   An explicitly requested implementation that cannot run raises :class:`KernelUnavailable`: never a silent
   fallback. That includes operands a Pallas kernel cannot take on the target (``Op(pallas_unsupported=...)``:
   shape limits of a backend's block rules, e.g. a GPU page size that is not a power of two); the automatic
   choice passes over the kernel for them, runs the reference and logs why (once per op and reason).

2. **Places the op on the mesh** (:func:`place`). With a :class:`Placement` of more than one device (the model
   passes one for every sharded run, on CPU as on TPU/GPU) the chosen implementation runs inside
   ``jax.shard_map`` on its local shard, split as the op's :class:`Rule` declares: Mosaic refuses to be
   partitioned automatically, and GSPMD partitions a Triton or FFI custom call by giving it whole, gathered
   operands. Ops whose rule is ``None`` are plain XLA under a mesh (GSPMD partitions them): their custom
   kernels are not chosen there.

The target platform is the platform of the placement's mesh when there is one, else that of an abstract mesh
set for tracing (``jax.sharding.use_abstract_mesh``: how tests lower for TPU/CUDA on a CPU machine), else
``jax.default_backend()``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

REFERENCE = "reference"
PALLAS = "pallas"
INTERPRET = "pallas_interpret"
NATIVE = "cpu_native"
XLA_CPU = "xla_cpu"


class KernelUnavailable(RuntimeError):
    """An explicitly requested kernel implementation cannot run here."""


# -- where ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh and the mesh axes each logical axis may be split over, in split order (the model's layout table,
    e.g. ``batch -> (data, expert)``, ``heads -> (model,)``). Hashable: it lives in static run configs."""

    mesh: Any  # jax.sharding.Mesh (or AbstractMesh)
    rules: tuple[tuple[str, tuple[str, ...]], ...]

    def mesh_axes(self, logical: str) -> tuple[str, ...]:
        return dict(self.rules).get(logical, ())

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.shape.values())


@dataclasses.dataclass(frozen=True)
class Rule:
    """How an op splits over a mesh.

    ``args`` / ``out``: one letter per dimension of each array operand and result (``"BTHK"``; ``None`` for an
    operand that is not an array; one string for every leaf of a pytree operand such as an MXFP4 weight).
    ``split``: the letters that may be split, each with the logical axis whose mesh axes it takes
    (``(("B", "batch"), ("H", "heads"))``). A logical axis takes the longest prefix of its mesh axes (size-1 axes
    left out, none taken by an earlier one) whose product divides every dimension carrying one of its letters
    (query heads H and kv heads G: one decision); everything else is whole on every device. Split letters must
    be independent (no reduction runs over them), so the local results are the global ones' shards and no
    collective is needed, except:

    ``merge``: the key letter of an attention op (``"S"``), listed in ``split`` like the others, over which the op
    reduces by a softmax. Where it is split, each device runs the implementation with ``with_lse=True`` on its
    slice of keys, which returns its partial result (normalised over those keys; zeros where a query sees none of
    them) and its log-sum-exp of scores ``lse`` (``-inf`` there; shape: the result's less its last dimension).
    Keys sit at their absolute positions and queries see keys at positions <= their own, so the query positions
    (operand ``positions``) are shifted by the slice's first position. The partials merge exactly by their softmax
    weights ``exp(lse - max lse)``: one max and two sums over the split axes, each the size of the result.
    A caller of such an op may ask for the log-sum-exp too (``with_lse=True``: the result and its lse over every
    key, split or not; to merge it with attention over other keys, e.g. a drafter's block over its context).
    """

    args: tuple[str | None, ...]
    out: str | tuple[str, ...]
    split: tuple[tuple[str, str], ...] = ()
    merge: str | None = None
    positions: int | None = None

    def __post_init__(self):
        if self.merge is not None and (self.positions is None or self.merge not in dict(self.split)
                                       or not isinstance(self.out, str) or self.merge in self.out):
            raise ValueError(f"Rule: merge={self.merge!r} needs a split letter absent from the one result and the "
                             f"index of the query positions operand")


def _leaves_with_letters(rule: Rule, args):
    for letters, a in zip(rule.args, args):
        if letters is not None and a is not None:
            for leaf in jax.tree.leaves(a):
                yield letters, leaf


def dividing_prefix(axes, sizes, dims, taken=()) -> tuple[str, ...]:
    """The longest prefix of ``axes`` (mesh axes of size 1 left out, none of ``taken``) whose product divides every
    size in ``dims``: how a logical axis is split, for kernel operands here and for parameters and caches
    (``kimi_jax.parallel.sharding``)."""
    chosen, n = [], 1
    for axis in axes:
        k = sizes.get(axis, 1)
        if k == 1:
            continue
        if axis in taken or any(d % (n * k) for d in dims):
            break
        chosen.append(axis)
        n *= k
    return tuple(chosen)


def split_axes(rule: Rule, placement: Placement, args) -> dict[str, tuple[str, ...]]:
    """Letter -> mesh axes it is split over, for these operands (see :class:`Rule`). Letters of one logical axis
    (query and kv heads) share one decision, made over all their dimensions."""
    sizes = dict(placement.mesh.shape)
    taken: set[str] = set()
    out = {}
    for logical in dict.fromkeys(lg for _, lg in rule.split):
        letters = {c for c, lg in rule.split if lg == logical}
        dims = [leaf.shape[i] for spec, leaf in _leaves_with_letters(rule, args)
                for i, c in enumerate(spec) if c in letters]
        chosen = dividing_prefix(placement.mesh_axes(logical), sizes, dims, taken)
        if dims and chosen:
            out.update(dict.fromkeys(letters, chosen))
            taken.update(chosen)
    return out


def _spec(letters: str, split: dict[str, tuple[str, ...]]) -> P:
    parts = [split.get(c) for c in letters]
    return P(*[None if not a else (a[0] if len(a) == 1 else a) for a in parts])


def place(fn: Callable, rule: Rule | None, placement: Placement | None, *args, with_lse: bool = False):
    """``fn(*args)``, inside ``jax.shard_map`` on each device's shard when ``placement`` spans several devices.
    ``None`` operands stay ``None`` (closed over, not passed through the map). ``with_lse`` (an op with
    ``rule.merge``): ``fn`` returns (result, lse), and so does this, the lse over every key."""
    if placement is None or placement.devices == 1 or rule is None:
        return fn(*args)
    split = split_axes(rule, placement, args)
    present = [i for i, a in enumerate(args) if a is not None]
    in_specs = tuple(jax.tree.map(lambda _, s=_spec(rule.args[i], split): s, args[i]) for i in present)
    outs = rule.out
    out_specs = _spec(outs, split) if isinstance(outs, str) else tuple(_spec(o, split) for o in outs)
    if with_lse:
        out_specs = (out_specs, _spec(outs[:-1], split))
    merged = split.get(rule.merge, ()) if rule.merge is not None else ()
    if merged:
        n_keys = next(leaf.shape[spec.index(rule.merge)] for spec, leaf in _leaves_with_letters(rule, args)
                      if rule.merge in spec)
        local_keys = n_keys // math.prod(placement.mesh.shape[a] for a in merged)

    def body(*local):
        full = list(args)
        for i, a in zip(present, local):
            full[i] = a
        if not merged:
            return fn(*full)
        first = jax.lax.axis_index(merged) * local_keys  # absolute position of this device's first key
        full[rule.positions] = full[rule.positions] - first.astype(full[rule.positions].dtype)
        return merge_partials(*fn(*full, with_lse=True), merged, with_lse=with_lse)

    return jax.shard_map(body, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*(args[i] for i in present))


def merge_partials(out, lse, axes, *, with_lse: bool = False):
    """The softmax-weighted merge of per-device partial attention results ``out`` ``[..., U]`` with their
    log-sum-exps ``lse`` ``[...]`` over mesh ``axes`` (inside ``shard_map``); queries that saw no key anywhere get
    zeros (and with ``with_lse`` the merged lse, ``-inf`` there)."""
    top = jax.lax.pmax(lse, axes)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)  # exp(-inf) = 0 for a device where the query saw nothing
    num = jax.lax.psum(out * w[..., None], axes)
    den = jax.lax.psum(w, axes)
    merged = num / jnp.where(den > 0, den, 1.0)[..., None]
    return (merged, top + jnp.log(den)) if with_lse else merged


# -- which ----------------------------------------------------------------------------------------------------


# XLA:TPU (libtpu 0.0.51) on TPU7x gives every stacked bfloat16 weight that a scanned model carries through its layer
# loop the T(16,128) tiling, and copies each whole stack into it before the loop from the T(8,128) tiling the
# parameters arrive in (and the dots read unrolled): a second copy of the scanned weights, 14.4 GB per device on
# full K3 (tpu7x 4x4x2, expert=8 x model=8). With this flag off the loop keeps the arriving tiling and the
# dots read each layer's slice where it lies: the same program but for layouts (full K3 serving decode step:
# temporaries 16.92 -> 2.50 GB, bytes accessed 124.5 -> 23.6 GB per device; docs/scale.md).
TPU_SCAN_OPTIONS = {"xla_tpu_control_large_2nd_minor_layout_for_x16": "false"}


def compiler_options(placement: Placement | None = None, *, scanned: bool = False) -> dict[str, str] | None:
    """XLA compiler options for a program that runs a model on ``placement`` (:func:`target_platform`), or None:
    :data:`TPU_SCAN_OPTIONS` for scanned layers on TPU (the flags name XLA:TPU options, which other compilers
    refuse)."""
    if scanned and target_platform(placement) == "tpu":
        return dict(TPU_SCAN_OPTIONS)
    return None


def target_platform(placement: Placement | None = None) -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: what the current trace is lowered for."""
    platform = None
    if placement is not None:
        mesh = placement.mesh
        if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
            platform = mesh.devices.flat[0].platform
        elif getattr(mesh, "abstract_device", None) is not None:
            platform = mesh.abstract_device.platform
    if platform is None:
        mesh = jax.sharding.get_abstract_mesh()
        device = getattr(mesh, "abstract_device", None)
        platform = device.platform if (device is not None and not mesh.empty) else jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def slices_from_host(dtypes, platform: str) -> bool:
    """Whether ``platform``'s compiler copies a dynamic slice of a host-memory array of each of ``dtypes`` as just
    the slice. XLA:TPU (libtpu 0.0.50, v5e / v5p / v6e) does not for 8-bit arrays (MXFP4 codes and scales): it
    gives the slice another tiling than the host array's and round-trips the whole array through the device to
    relayout it, every step; 16- and 32-bit arrays slice directly. XLA:GPU slices any dtype; XLA:CPU has one
    memory."""
    return platform != "tpu" or all(jnp.dtype(d).itemsize >= 2 for d in dtypes)


def host_slices(leaves, placement: Placement | None = None) -> bool:
    """:func:`slices_from_host` for these arrays on the current target: whether offloaded routed experts can move
    one chosen expert at a time (``kimi_jax.model.offload.fetch_experts``) or must move whole layers."""
    return slices_from_host([a.dtype for a in leaves], target_platform(placement))


@dataclasses.dataclass(frozen=True)
class CpuImpl:
    """A CPU-only implementation of an op: a native C++ kernel (``"cpu_native"``) or an XLA form tuned for
    XLA:CPU (``"xla_cpu"``). ``unsupported(*args, **static)`` -> why it cannot take these operands, or None;
    ``ready()`` -> whether it can run (a native kernel builds on first use); ``automatic(*args, **static)`` ->
    whether the automatic choice takes it for this call (where it was measured faster)."""

    name: str
    fn: Callable
    unsupported: Callable = lambda *args, **static: None
    ready: Callable = lambda: True
    automatic: Callable = lambda *args, **static: True


_logged: set[tuple[str, str]] = set()


def _passed_over(op: str, why: str, kernel: str = "CPU") -> None:
    if (op, why) not in _logged:
        _logged.add((op, why))
        log.info("%s: automatic choice passes over its %s kernel: %s", op, kernel, why)


class Op:
    """One kernel op: its implementations, the automatic choice between them, and its partition rule.

    ``impls`` maps names to callables ``fn(*args, **static)``; the Pallas entries (``"pallas"``, taken for
    ``"pallas_interpret"`` too) also receive ``platform=`` and ``interpret=``. ``cpu``: CPU-only implementations,
    tried in order by the automatic choice on CPU; with ``rule=None`` they run on one device only (a custom call
    that GSPMD would partition by gathering its operands, or a form tuned for one device's XLA:CPU).
    ``forms``: other plain-XLA implementations (:class:`CpuImpl` entries, though not CPU-only), which any platform
    may run: the automatic choice takes the first whose ``automatic`` holds for these operands where no Pallas or
    CPU kernel was taken (e.g. a form that streams a long operand in blocks, bounded in memory).
    ``plain``: an op of plain XLA products, with a Pallas form for some operands at most; a run that asks for the
    Pallas kernels (``"pallas"`` / ``"pallas_interpret"`` apply to every op of a model) runs its reference where
    that form cannot run.
    ``defaults``: ``{static argument: {platform: value}}`` for static arguments the caller leaves None, decided
    for the target platform before the choice (``None`` as the platform key: every other platform), so the
    implementations themselves never look at the platform.
    ``pallas_unsupported(platform, *args, **static)``: why the Pallas kernel cannot take these operands when
    compiled for ``platform`` (``"gpu"`` for ``"pallas_interpret"``, which runs the GPU block rules), or None.
    """

    def __init__(self, name: str, rule: Rule | None, impls: dict[str, Callable], cpu: tuple[CpuImpl, ...] = (),
                 forms: tuple[CpuImpl, ...] = (), plain: bool = False, defaults: dict[str, dict] | None = None,
                 pallas_unsupported: Callable = lambda platform, *args, **static: None):
        self.name, self.rule, self.cpu, self.plain = name, rule, tuple(cpu), plain
        self.defaults = dict(defaults or {})
        self.pallas_unsupported = pallas_unsupported
        self.impls = dict(impls)
        if PALLAS in self.impls:
            self.impls[INTERPRET] = self.impls[PALLAS]
        self.impls.update({c.name: c.fn for c in self.cpu})
        self.forms = tuple(forms)
        self.impls.update({f.name: f.fn for f in self.forms})

    def _with_defaults(self, static: dict, placement) -> dict:
        for key, table in self.defaults.items():
            if static.get(key) is None:
                static[key] = table.get(target_platform(placement), table.get(None))
        return static

    def _cpu_here(self, placement) -> tuple[CpuImpl, ...]:
        return self.cpu if self._placeable(placement) else ()

    def _placeable(self, placement) -> bool:
        """Whether a custom kernel of this op may run under ``placement``: one with a rule places itself; one
        without runs on one device only (GSPMD would partition a Mosaic call not at all, a Triton or FFI call by
        gathering its operands), and on a mesh the op is plain XLA that GSPMD partitions."""
        return self.rule is not None or placement is None or placement.devices == 1

    def _automatic(self, platform, args, static, placement) -> str:
        if platform in ("tpu", "gpu") and PALLAS in self.impls and self._placeable(placement):
            why = self.pallas_unsupported(platform, *args, **static)
            if why is None:
                return PALLAS
            _passed_over(self.name, f"{why}; runs the reference", kernel="Pallas")
        if platform == "cpu":
            for c in self._cpu_here(placement):
                if not c.automatic(*args, **static):
                    continue
                why = c.unsupported(*args, **static)
                if why is None and c.ready():
                    return c.name
                if why is not None:
                    _passed_over(self.name, why)
        return self._form(args, static)

    def _form(self, args, static) -> str:
        """The first of ``forms`` the automatic choice takes for these operands, else the reference."""
        for f in self.forms:
            if f.automatic(*args, **static) and f.unsupported(*args, **static) is None:
                return f.name
        return REFERENCE

    def choose(self, implementation: str | None, args=(), static=None, placement: Placement | None = None) -> str:
        """The implementation name this call runs (see the module docstring)."""
        static = self._with_defaults(dict(static or {}), placement)
        platform = target_platform(placement)
        if implementation is None:
            return self._automatic(platform, args, static, placement)
        if implementation in (PALLAS, INTERPRET):
            runs = (implementation in self.impls and self._placeable(placement)
                    and (implementation == INTERPRET or platform in ("tpu", "gpu")))
            if not runs and (self.plain or not self._placeable(placement)):
                # a model-wide "pallas" applies to every op; this one has no kernel that runs here
                return self._form(args, static)
        if implementation not in self.impls:
            raise KernelUnavailable(f"{self.name}: implementation={implementation!r} is not available "
                                    f"(choose from {sorted(self.impls)})")
        if implementation == PALLAS and platform not in ("tpu", "gpu"):
            raise KernelUnavailable(
                f"{self.name}: implementation='pallas' needs a TPU or GPU, but the target platform is {platform!r}; "
                f"use implementation='{INTERPRET}' to run the Pallas kernel in interpret mode on CPU")
        if implementation in (PALLAS, INTERPRET):
            why = self.pallas_unsupported("gpu" if implementation == INTERPRET else platform, *args, **static)
            if why is not None:
                raise KernelUnavailable(f"{self.name}: implementation={implementation!r} cannot run here: {why}")
        cpu = {c.name: c for c in self.cpu}
        if implementation in cpu:
            if platform != "cpu":
                raise KernelUnavailable(f"{self.name}: implementation={implementation!r} runs on CPU only, "
                                        f"not on {platform!r}")
            if cpu[implementation] not in self._cpu_here(placement):
                raise KernelUnavailable(f"{self.name}: implementation={implementation!r} has no partition rule for "
                                        f"a mesh of {placement.devices} devices")
            why = cpu[implementation].unsupported(*args, **static)
            if why is not None:
                raise KernelUnavailable(f"{self.name}: {why}")
        return implementation

    def __call__(self, *args, implementation: str | None = None, placement: Placement | None = None, **static):
        static = self._with_defaults(static, placement)
        impl = self.choose(implementation, args, static, placement)
        fn = self.impls[impl]
        kw = dict(static)
        if impl in (PALLAS, INTERPRET):
            kw.update(platform="gpu" if impl == INTERPRET else target_platform(placement),
                      interpret=impl == INTERPRET)
        return place(lambda *a, **extra: fn(*a, **{**kw, **extra}), self.rule, placement, *args,
                     with_lse=bool(kw.get("with_lse")))
