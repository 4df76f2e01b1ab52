"""Structured outputs: grammar-constrained decoding with xgrammar (see manager.py)."""
