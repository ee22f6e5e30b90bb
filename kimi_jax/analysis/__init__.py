"""Analysis behind the notebooks: devices, routing, AttnRes weights, KDA state norms, memory curves."""
