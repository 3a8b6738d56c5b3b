"""Qwen3 (dense): registers nothing.

transformers 5.24 trains it verbatim here: packed attention is masked per document from the
position restarts, checkpoint names equal parameter names, and a tied output head (the small
Qwen3 sizes) is left out of published weights by the weight source itself.
"""
