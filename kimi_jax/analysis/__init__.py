"""Analysis behind the notebooks: devices, routing, AttnRes weights, KDA state norms, memory curves.

One module per concern; the notebooks import the modules (``from kimi_jax.analysis import probes, plots``):

* :mod:`~kimi_jax.analysis.devices`: the device list, generation speeds, mesh sizes, bytes per device, shard tables,
  the per-device memory report.
* :mod:`~kimi_jax.analysis.hub`: the first layers' shards of a Hub checkpoint, and downloading only those.
* :mod:`~kimi_jax.analysis.probes`: what a forward pass routes and mixes (experts, AttnRes weights) and the KDA state
  norms of a continued prefill.
* :mod:`~kimi_jax.analysis.memory`: decode-cache bytes vs context, measured allocations, the MLA / KDA crossover.
* :mod:`~kimi_jax.analysis.deployments`: common K3 deployments as plan rows, roofline throughput vs batch.
* :mod:`~kimi_jax.analysis.tables` and :mod:`~kimi_jax.analysis.plots`: markdown tables and matplotlib figures.

Everything but the figures returns plain numpy / dicts so it can be checked in tests.
"""
