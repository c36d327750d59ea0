"""Serving IceCache inside other engines: the vLLM plugin (docs/serving.md)."""
