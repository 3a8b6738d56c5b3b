"""Shipped architecture specs; importing this package registers them all.

This list is the source of truth for which architectures have an adaptation spec.
"""
