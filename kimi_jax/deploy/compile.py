"""One step of a model compiled with abstract, sharded parameters and cache (nothing allocated), and what the
compiler says of it: per-device memory, the Pallas kernels it holds, the bytes it copies from host memory.

``mesh`` holds CPU devices or a deviceless TPU / GPU topology's (:mod:`kimi_jax.deploy.aot`); tracing happens
under it, so the kernel ops' automatic choice sees that platform.
"""

from __future__ import annotations

import re
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kimi_jax.generation import speculative
from kimi_jax.generation.generate import prefill_chunk_drafted
from kimi_jax.generation.sampling import DecodeState, Sampling
from kimi_jax.model import dspark, params
from kimi_jax.model.cache import cache_shapes, paged_cache_shapes
from kimi_jax.model.decoder import abstract_model
from kimi_jax.model.hot_experts import routed_experts
from kimi_jax.model.offload import HOST, HotExperts, cache_host_shardings
from kimi_jax.model.quantize import quantize as quantize_model
from kimi_jax.model.run import RunConfig, check_offload
from kimi_jax.parallel import sharding
from kimi_jax.serving import steps as serving_steps


class StepInputs(NamedTuple):
    """A model step's abstract inputs: ``nnx.merge(graphdef, *states)`` is the model (``states``: its parameters,
    and its hot experts first when it has them), ``ids`` ``[batch, tokens]``, ``cache``; ``out_shardings``: those
    of (logits, cache)."""

    graphdef: Any
    states: tuple
    ids: Any
    cache: Any
    out_shardings: tuple


def step_inputs(cfg, mesh, layout="tp_ep", *, batch: int, context: int, tokens: int = 1, dtype="bfloat16",
                implementation: str | None = None, scan_layers: bool = False, quantize: str | None = None,
                kv_cache: str | None = None, kda_state=None, offload=(), hot_experts: int = 0,
                parallel: bool = True) -> StepInputs:
    """Abstract parameters, ids and cache of one step, sharded by :mod:`kimi_jax.parallel.sharding` on ``mesh``
    (arguments as :func:`compile_step`)."""
    kinds = check_offload(offload)
    dt = jnp.dtype(dtype)
    lay = sharding.layout(layout)
    run = RunConfig(dtype=dt, implementation=implementation, offload=kinds, scan_layers=scan_layers,
                    parallel=sharding.Parallel(mesh, lay) if parallel else None)
    model = abstract_model(cfg, run)
    if quantize is not None:
        model = quantize_model(model, quantize)
    target = mesh.abstract_mesh if kinds else mesh

    def shard(spec, host=False):
        return NamedSharding(target, spec, memory_kind=HOST if host else "device") if kinds else \
            NamedSharding(target, spec)

    if hot_experts:
        _abstract_hot_experts(model, cfg, hot_experts, kinds, parallel, scan_layers, shard(PartitionSpec()))
        graphdef, hot, state = nnx.split(model, HotExperts, ...)
    else:
        (graphdef, state), hot = nnx.split(model), None
    specs = sharding.param_specs(model, mesh, lay)
    offloaded = lambda key: "experts" in kinds and ".experts.w" in key  # noqa: E731
    state = params.fill(state, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shard(specs[k], offloaded(k)))
                                for k, v in params.leaves(state).items()})
    shapes = cache_shapes(cfg, batch, context, dt, scan=scan_layers, kv_cache=kv_cache, kda_state=kda_state)
    cspecs = sharding.cache_specs(cfg, shapes, mesh, lay)
    cshard = cache_host_shardings(jax.tree.map(shard, cspecs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
                                  shapes, kinds)
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, cshard)
    bspec = sharding.batch_spec((batch, tokens), mesh, lay)
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=shard(bspec))
    head = "lm_head" if "lm_head" in specs else "embed_tokens"
    logits = shard(PartitionSpec(bspec[0], None, specs[head][0]))
    return StepInputs(graphdef, (state,) if hot is None else (hot, state), ids, cache, (logits, cshard))


def compile_step(cfg, mesh, layout="tp_ep", *, batch: int, context: int, tokens: int = 1, dtype="bfloat16",
                 implementation: str | None = None, scan_layers: bool = False, quantize: str | None = None,
                 kv_cache: str | None = None, kda_state=None, offload=(), hot_experts: int = 0,
                 parallel: bool = True) -> dict:
    """Lower and compile one step on ``mesh``: a decode step (``tokens == 1``: ``[batch, 1]`` ids after the cached
    prefix) or a fresh prefill chunk (``[batch, tokens]`` ids into the static cache, last position's logits), as
    :mod:`kimi_jax.generation.generate` runs them.

    ``scan_layers``: the repeating run of layers as one scan (:mod:`kimi_jax.model.layer_plan`). ``quantize``: the
    weight-only format of the parameters (:func:`kimi_jax.model.quantize.quantize`). ``kv_cache`` / ``kda_state``:
    the cache's storage options (:func:`kimi_jax.model.cache.cache_shapes`). ``offload``: the kinds kept in host
    memory (:mod:`kimi_jax.model.offload`); their arguments carry shardings over ``mesh.abstract_mesh``, since the
    deviceless GPU client reports no memory kinds and a concrete GPU mesh would drop ``pinned_host`` silently.
    ``hot_experts``: with ``"experts"`` offloaded, that many experts per MoE layer also in device memory
    (:mod:`kimi_jax.model.hot_experts`, abstract here), one ``lax.cond`` per routed slot. ``parallel=False``: the
    single-device model (no ``Parallel`` in its run; ``mesh`` of one device).

    Returns per device the ``argument`` / ``output`` / ``alias`` / ``temp`` / ``generated_code`` bytes, their
    ``host_*`` counterparts, ``peak`` (device), ``compile_seconds``, ``pallas_calls`` (compiled Pallas kernels in
    the program), ``bytes_accessed`` (the compiler's cost analysis), and ``h2d`` / ``h2d_always``: the bytes one
    step copies host -> device, counting the copies inside ``lax.cond`` branches or not (None where the program
    does not say how often a loop runs; 0 with nothing offloaded).
    """
    graphdef, states, ids, cache, out_shardings = step_inputs(
        cfg, mesh, layout, batch=batch, context=context, tokens=tokens, dtype=dtype, implementation=implementation,
        scan_layers=scan_layers, quantize=quantize, kv_cache=kv_cache, kda_state=kda_state, offload=offload,
        hot_experts=hot_experts, parallel=parallel)

    def step(states, ids, cache):
        out = nnx.merge(graphdef, *states)(ids, cache=cache, prefix=tokens == 1, last_only=True)
        return out.logits, out.cache

    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        # keep_unused: a deployed model holds every weight (layer 0's AttnRes mix, which has no block to mix, too)
        compiled = jax.jit(step, donate_argnums=(2,), out_shardings=out_shardings, keep_unused=True,
                           compiler_options=_compiler_options(graphdef, states)).lower(states, ids, cache).compile()
    return _report(compiled, time.perf_counter() - t0, bool(check_offload(offload)))


def compile_speculative(cfg, mesh, layout="tp_ep", *, batch: int, context: int, drafter, dtype="bfloat16",
                        implementation: str | None = None, scan_layers: bool = False, quantize: str | None = None,
                        kv_cache: str | None = None, kda_state=None) -> dict:
    """Compile ``generate``'s speculative decode loop (:func:`kimi_jax.generation.speculative.decode`: the
    ``drafter``, the verify forward over ``k + 1`` positions with the KDA layers in verify mode, the acceptance and
    the cache commit, and the plain one-position step for when no row drafts, in one ``while_loop``) for ``batch``
    sequences in a cache of ``context`` positions, a history of ``context`` tokens (prompt + output, as ``generate``
    keeps it). Reports as :func:`compile_step` does.

    ``drafter``: an :class:`~kimi_jax.generation.speculative.NGram`, or a
    :class:`~kimi_jax.generation.speculative.DSpark` (loaded or abstract: only its config and ``k`` are used), whose
    weights (in ``dtype``) and context cache (:class:`~kimi_jax.model.dspark.DraftCache`, ``context`` positions)
    are abstract arguments split over ``mesh`` (:func:`drafter_inputs`), as ``generate`` places them; the verify
    forward then also returns the target's hidden states and the loop writes the drafter's context from the tapped
    layers."""
    graphdef, states, _, cache, _ = step_inputs(
        cfg, mesh, layout, batch=batch, context=context, dtype=dtype, implementation=implementation,
        scan_layers=scan_layers, quantize=quantize, kv_cache=kv_cache, kda_state=kda_state)
    whole = NamedSharding(mesh, PartitionSpec())
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)  # noqa: E731
    i32, f32, B = jnp.int32, jnp.float32, batch
    static, dgraph, dparams, dcache = drafter_inputs(drafter, mesh, batch=batch, context=context, dtype=dtype,
                                                     layout=layout)
    dec = DecodeState(cache, arg((B,), i32), arg((B, context), i32), arg((B,), i32), arg((B,), jnp.bool_))
    state = speculative.SpecState(dec, arg((B, context), i32), arg((B,), i32), arg((B,), i32), arg((B,), i32),
                                  arg((B,), i32), arg((B,), i32), arg((B,), f32), arg((), f32), dcache)
    samp = Sampling(arg((B,), f32), arg((B,), i32), arg((B,), f32), arg((B,), i32), arg((4,), i32),
                    arg((), jnp.uint32))
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = speculative.decode.lower(graphdef, *states, state, samp, arg((), i32), drafter=static,
                                            dgraph=dgraph, dparams=dparams).compile(
            _compiler_options(graphdef, states))
    return _report(compiled, time.perf_counter() - t0, False)


def drafter_inputs(drafter, mesh, *, batch: int, context: int, dtype="bfloat16", layout="tp_ep"):
    """(the loop's static drafter, the drafter's graph, its abstract weights, its abstract context cache) for
    ``drafter`` on ``mesh``: for an n-gram drafter ``(drafter, None, None, None)``; for a DSpark drafter, run on the
    target's mesh, its weights in ``dtype`` split by their logical axes and a
    :class:`~kimi_jax.model.dspark.DraftCache` of ``[layers, batch, context, kv_lora_rank]`` + ``kpe`` split as the
    target's latent cache (as ``generate`` places both on its mesh)."""
    if not isinstance(drafter, speculative.DSpark):
        return drafter, None, None, None
    dt = jnp.dtype(dtype)
    dcfg = drafter.model.cfg
    lay = sharding.layout(layout)
    run = RunConfig(dtype=dt, parallel=sharding.Parallel(mesh, lay))
    use = speculative.DSpark(dspark.abstract(dcfg, dt, run), drafter.k)
    static, dgraph, weights = speculative.static(use)
    specs = sharding.param_specs(use.model, mesh, lay)
    dparams = params.fill(weights, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                                    for k, v in params.leaves(weights).items()})
    dcache = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                          dspark.cache_shapes(dcfg, batch, context, dt),
                          sharding.draft_cache_shardings(dcfg, batch, context, mesh, lay))
    return static, dgraph, dparams, dcache


def serve_drafter_inputs(drafter, mesh, shapes, *, dtype="bfloat16", layout="tp_ep"):
    """(the drafter's graph, its abstract weights, its abstract page pools) as the serving engine holds a DSpark
    ``drafter`` on ``mesh`` (:class:`~kimi_jax.serving.executor.Executor`): its weights in ``dtype`` split by their
    logical axes (as :func:`drafter_inputs`), its context pools ``[layers, n_pages, page_size, ...]`` for the
    engine's ``shapes`` replicated, as the target's latent pools are."""
    _, dgraph, dparams, _ = drafter_inputs(drafter, mesh, batch=1, context=1, dtype=dtype, layout=layout)
    whole = NamedSharding(mesh, PartitionSpec())
    pools = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole),
                         dspark.cache_shapes(drafter.model.cfg, shapes.n_pages, shapes.page_size, dtype))
    return dgraph, dparams, pools


def compile_prefill_tapped(cfg, mesh, layout="tp_ep", *, batch: int, context: int, tokens: int, drafter,
                           dtype="bfloat16", implementation: str | None = None, scan_layers: bool = False,
                           quantize: str | None = None, kv_cache: str | None = None, kda_state=None) -> dict:
    """Compile the prefill chunk ``generate`` runs with a DSpark ``drafter``
    (:func:`kimi_jax.generation.generate.prefill_chunk_drafted`: ``[batch, tokens]`` ids continuing the cache, the
    target's hidden states at the tapped layers written into the drafter's context cache), its weights and cache
    abstract and split as in :func:`compile_speculative`. Reports as :func:`compile_step` does."""
    if not isinstance(drafter, speculative.DSpark):
        raise TypeError("compile_prefill_tapped: a DSpark drafter writes a context from the prefill; this is "
                         f"{type(drafter).__name__}")
    graphdef, states, ids, cache, _ = step_inputs(
        cfg, mesh, layout, batch=batch, context=context, tokens=tokens, dtype=dtype, implementation=implementation,
        scan_layers=scan_layers, quantize=quantize, kv_cache=kv_cache, kda_state=kda_state)
    static, dgraph, dparams, dcache = drafter_inputs(drafter, mesh, batch=batch, context=context, dtype=dtype,
                                                     layout=layout)
    whole = NamedSharding(mesh, PartitionSpec())
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=whole)
    last = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32, sharding=whole)
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        compiled = prefill_chunk_drafted.lower(
            graphdef, *states, cache, ids, lengths, last, static, dgraph, dparams, dcache).compile(
            _compiler_options(graphdef, states))
    return _report(compiled, time.perf_counter() - t0, False)


def compile_serve(cfg, mesh, layout="tp_ep", *, shapes, dtype="bfloat16", implementation: str | None = None,
                  scan_layers: bool = False, quantize: str | None = None, drafter=None) -> dict:
    """Compile the serving engine's programs as ``kimi-jax serve --mesh`` runs them (:mod:`kimi_jax.serving.steps`,
    over the paged cache of ``shapes``, a :class:`kimi_jax.serving.stepplan.Shapes`): the decode step over every
    slot reading the widest page table, and a prefill chunk of ``shapes.chunk`` tokens continuing a sequence (the
    chunk that reads the cache; the largest of the chunk buckets). Abstract sharded parameters and cache, nothing
    allocated. Returns ``{"decode": report, "prefill": report}`` (each as :func:`compile_step` reports).

    ``drafter`` (``kimi-jax serve --speculative``: an n-gram or a DSpark drafter, which may be abstract): also the
    verify step over every slot (``k + 1`` positions each, returning the tapped hidden states for a DSpark drafter)
    as ``"verify"``, and for a DSpark drafter its step (the kept positions' context written into its page pools, a
    block drafted per slot) as ``"draft"``, with its weights split as the engine places them and its pools
    replicated (:func:`serve_drafter_inputs`)."""
    dt = jnp.dtype(dtype)
    lay = sharding.layout(layout)
    run = RunConfig(dtype=dt, implementation=implementation, scan_layers=scan_layers,
                    parallel=sharding.Parallel(mesh, lay))
    model = abstract_model(cfg, run)
    if quantize is not None:
        model = quantize_model(model, quantize)
    graphdef, state = nnx.split(model)
    specs = sharding.param_specs(model, mesh, lay)
    state = params.fill(state, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                                for k, v in params.leaves(state).items()})
    sh = shapes
    cshapes = paged_cache_shapes(cfg, sh.slots, sh.n_pages, sh.page_size, dt, scan=scan_layers)
    cshard = sharding.paged_cache_shardings(cfg, cshapes, mesh, lay)
    cache = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), cshapes, cshard)
    whole = NamedSharding(mesh, PartitionSpec())
    progs = serving_steps.programs(graphdef, cshard, whole, compiler_options=run.compiler_options())
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)  # noqa: E731
    samp = lambda b: serving_steps.SlotSampling(arg((b,), jnp.float32), arg((b,), jnp.int32),  # noqa: E731
                                               arg((b,), jnp.float32), arg((b,), jnp.uint32), arg((b,), jnp.int32))
    i32 = jnp.int32
    out = {}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
        t0 = time.perf_counter()
        decode = progs.decode_step.lower(state, cache, arg((sh.slots, sh.pages_per_seq), i32), arg((sh.slots,), i32),
                                         arg((sh.slots,), jnp.bool_), samp(sh.slots), None, record=False).compile()
        out["decode"] = _report(decode, time.perf_counter() - t0, False)
        t0 = time.perf_counter()
        prefill = progs.prefill_chunk.lower(state, cache, arg((1, sh.pages_per_seq), i32), arg((), i32),
                                            arg((1, sh.chunk), i32), arg((), i32), samp(1), fresh=False,
                                            record=False).compile()
        out["prefill"] = _report(prefill, time.perf_counter() - t0, False)
        if drafter is not None:
            out.update(_compile_serve_drafting(cfg, mesh, layout, sh, drafter, dt, progs, state, cache, samp))
    return out


def _compile_serve_drafting(cfg, mesh, layout, sh, drafter, dt, progs, state, cache, samp) -> dict:
    """The engine's verify step and a DSpark drafter's step, compiled (:func:`compile_serve`; under its mesh)."""
    whole = NamedSharding(mesh, PartitionSpec())
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)  # noqa: E731
    i32, B, K1 = jnp.int32, sh.slots, drafter.k + 1
    dcfg = drafter.model.cfg if isinstance(drafter, speculative.DSpark) else None
    tap = None if dcfg is None else (tuple(dcfg.target_layer_ids), dcfg.aux_hidden_stream)
    table = arg((B, sh.pages_per_seq), i32)
    t0 = time.perf_counter()
    verify = progs.verify_step.lower(state, cache, table, arg((B, K1), i32), arg((B,), i32),
                                     arg((B,), jnp.bool_), samp(B), None, record=False, tap=tap).compile()
    out = {"verify": _report(verify, time.perf_counter() - t0, False)}
    if dcfg is None:
        return out
    dgraph, dparams, pools = serve_drafter_inputs(drafter, mesh, sh, dtype=dt, layout=layout)
    leaves = params.leaves(state)
    head = (leaves["embed_tokens"], leaves["embed_tokens" if cfg.tie_word_embeddings else "lm_head"])
    taps = arg((B, K1, len(dcfg.target_layer_ids) * dcfg.target_hidden_size), dt)
    t0 = time.perf_counter()
    draft = serving_steps.draft_programs(dgraph, drafter.k, whole, whole).draft_step.lower(
        dparams, pools, *head, taps, table, arg((B,), i32), arg((B,), i32), arg((B, K1), i32), arg((B,), i32),
        arg((), jnp.bool_)).compile()
    out["draft"] = _report(draft, time.perf_counter() - t0, False)
    return out


def _compiler_options(graphdef, states) -> dict | None:
    """The model's compiler options (:meth:`kimi_jax.model.run.RunConfig.compiler_options`; under the mesh that the
    program is compiled for)."""
    return nnx.merge(graphdef, *states).run.compiler_options()


def _abstract_hot_experts(model, cfg, per_layer, kinds, parallel, scan_layers, one):
    """Abstract :class:`HotExperts` of ``per_layer`` rows on every MoE layer (replicated device arrays)."""
    if "experts" not in kinds or parallel or scan_layers:
        raise ValueError("compile_step: hot_experts needs the experts offloaded on one device (parallel=False), "
                         "unscanned layers")
    for experts in routed_experts(model):
        rows = jax.tree.map(lambda v: jax.ShapeDtypeStruct((per_layer, *v.shape[1:]), v.dtype, sharding=one),
                            experts.weights())
        slot = jax.ShapeDtypeStruct((cfg.moe.num_experts,), jnp.int32, sharding=one)
        experts.hot_cache = HotExperts({"slot": slot, "rows": rows})


def _report(compiled, seconds: float, offloaded: bool) -> dict:
    m = compiled.memory_analysis()
    keys = ("argument", "output", "alias", "temp")
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in keys + ("generated_code",)}
    out.update({f"host_{k}": int(getattr(m, f"host_{k}_size_in_bytes")) for k in keys})
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compile_seconds"] = seconds
    text = compiled.as_text()
    out["pallas_calls"] = pallas_calls(text)
    out["bytes_accessed"] = float((compiled.cost_analysis() or {}).get("bytes accessed", 0.0))
    out["h2d"] = out["h2d_always"] = 0
    if offloaded:
        copies = _host_copies(text)
        try:
            out["h2d"] = copies(True)
            out["h2d_always"] = copies(False)  # less the cold-expert copies' branches
        except ValueError:  # copies inside a scan on TPU: the program does not say how often they run
            out["h2d"] = out["h2d_always"] = None
    return out


def pallas_calls(text: str) -> int:
    """Compiled Pallas kernels in a program's text: Mosaic (TPU) and Triton (GPU) custom calls."""
    return len(re.findall(r'custom_call_target="(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)"', text))


_HLO_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16,
             "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}
_HLO_SHAPE = re.compile(r"\b([a-z]+[0-9]+[a-z0-9]*|pred)\[([0-9,]*)\](\{[^}]*\})?")
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")


def host_to_device_bytes(hlo_text: str, conditional: bool = True) -> int:
    """Bytes one run of a compiled program copies host -> device, read from its scheduled HLO
    (``compiled.as_text()``): the result bytes of every asynchronous copy (``copy-start``) or slice / fusion
    (``dynamic-slice-start`` on TPU, ``fusion-start`` on GPU) or host computation (``custom-call-start``) whose
    first operand lives in host memory (layout ``S(5)``) and whose result does not, times the trip count of the while loops around it. Logical bytes: TPU tile padding
    is not counted. Raises ValueError for a host read inside a loop whose trip count the program does not state
    (XLA:TPU drops ``known_trip_count``). Copies inside a branch of a ``conditional`` (the cold experts of
    :func:`keep_hot_experts`) are counted as if their branch ran, unless ``conditional`` is False: then only the
    copies every run makes are."""
    return _host_copies(hlo_text)(conditional)


def _host_copies(hlo_text: str):
    """The scheduled program read once (:func:`host_to_device_bytes`): a function of ``conditional`` -> bytes."""
    def shapes(line):
        return [(t, dims, "S(5)" in (lay or "")) for t, dims, lay in _HLO_SHAPE.findall(line)]

    def nbytes(t, dims):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        return n * _HLO_BITS[t] // 8

    computation, reads, loops, branches = None, {}, {}, {}
    for line in hlo_text.splitlines():
        m = _HLO_COMPUTATION.match(line)
        if m:
            computation = m.group(1)
            continue
        rhs = line.partition(" = ")[2]
        if " while(" in rhs:
            body = re.search(r"body=%?([\w.\-]+)", rhs).group(1)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs)
            loops[body] = (computation, int(trips.group(1)) if trips else None)
        if " conditional(" in rhs:
            named = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rhs)
            listed = re.search(r"branch_computations=\{([^}]*)\}", rhs)
            for b in named + (re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else []):
                branches[b] = computation
        op = re.search(r"\s(copy-start|dynamic-slice-start|fusion-start|custom-call-start)\(", rhs)
        if not op:
            continue
        sh = shapes(rhs[: op.start()])
        if op.group(1) == "copy-start":
            (dt, dd, dh), (_, _, sh_host) = sh[0], sh[1]
            moved = nbytes(dt, dd) if sh_host and not dh else 0
        else:
            rt, rd, rh = sh[-2]
            moved = nbytes(rt, rd) if sh[0][2] and not rh else 0
        reads[computation] = reads.get(computation, 0) + moved

    def total(conditional: bool) -> int:
        def times(computation):
            if computation in branches:
                return int(conditional) * times(branches[computation])
            if computation not in loops:
                return 1
            parent, trips = loops[computation]
            if trips is None:
                raise ValueError(f"host -> device copies in loop body {computation} whose trip count is not stated")
            return trips * times(parent)

        return sum(b * times(c) for c, b in reads.items() if b)

    return total
