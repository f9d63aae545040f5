"""Shipped model configs, resolved by name in compiler.models."""
