"""Inference engines: SGLang or the built-in engine, their router, processes and health."""
