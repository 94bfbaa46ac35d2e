"""``python -m h2o_kv ...``: the same as the ``h2o-kv`` command."""

from .cli import app

app(prog_name="h2o-kv")
