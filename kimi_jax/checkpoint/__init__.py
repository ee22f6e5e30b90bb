"""Checkpoints: safetensors reading and writing, the name table, the one reader, HF and Orbax loading."""
