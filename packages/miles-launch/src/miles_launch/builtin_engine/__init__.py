"""The built-in engine: a HF causal LM behind SGLang's HTTP API (``python -m miles_launch.builtin_engine``).

A correctness and convenience default that runs anywhere (CPU or one GPU), not a rival to
SGLang. See docs/engine.md.
"""
