"""The transformers backend: the exact reference (cache.py + scoring.py), streaming (rotary.py), compat.py."""
