"""The README's Python blocks run as written, in order, on the default model, with no deprecation warning."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.mark.slow
def test_readme_python_blocks_run(default_model, capsys):
    from h2o_kv.hf.compat import CACHE_KWARG

    if CACHE_KWARG != "cache":
        pytest.skip("the README shows the newest transformers' generate(cache=...); this release wants past_key_values")
    assert BLOCKS, "the README shows no Python block"
    namespace = {"__name__": "__readme__"}  # one namespace, as a reader pasting the blocks one after the other
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, block in enumerate(BLOCKS, start=1):
            exec(compile(block, f"README.md, python block {number}", "exec"), namespace)
    deprecated = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, DeprecationWarning)
                  or issubclass(w.category, FutureWarning)]  # fmt: skip
    assert not deprecated
