"""The transformers backend: the exact reference (cache.py, slots.py, attention.py), streaming (rotary.py), compat."""
