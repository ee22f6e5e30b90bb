"""Deployment: per-chip plans of a model on a mesh, what offloading moves, and the real TPU / GPU compilers run
deviceless on the steps (``kimi-jax plan``)."""
