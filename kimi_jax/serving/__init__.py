"""Serving: the continuous-batching engine (`engine`) and the OpenAI-compatible HTTP server (`server`)."""
