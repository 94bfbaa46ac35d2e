"""The transformers backend: the exact reference (cache.py, slots.py, scoring.py), streaming (rotary.py), compat.py."""
