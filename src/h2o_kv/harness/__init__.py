"""The measuring harness shared by ``eval`` and ``bench``, outside the public core.

``setting`` (one KV setting: an h2o-kv policy or a kvpress press, its budget and options, built into a cache),
``peers`` (kvpress presses at the same kept-entry counts), ``records`` (result JSONs: commit, clean tree, versions,
command), ``tables`` (bootstrap and exact intervals), ``data`` (the shared evaluation data, read at run time).
"""
