"""Quality evaluation on real data: perplexity, lm-eval tasks, XSUM, needle-in-a-haystack, sweeps and reports."""
