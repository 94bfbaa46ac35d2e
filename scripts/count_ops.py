"""Count the torch operators an h2o-kv command dispatches, and its host synchronisations (``.item()``, ``int(t)``,
``bool(t)``: aten ``_local_scalar_dense``; and ``.tolist()``), on any device. On a GPU each operator is a launch
and each synchronisation drains the queue, so these counts measured on the CPU predict a setting's GPU overhead.

    python scripts/count_ops.py eval ruler --policy h2o --budget 0.2 --lengths 1024 --tasks niah_single --n 1

Arguments are the ``h2o-kv`` command's; prints the totals and the most frequent operators.
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h2o_kv.cli import app


class OperatorCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    counter, start, tolist = OperatorCount(), time.perf_counter(), torch.Tensor.tolist

    def counted_tolist(tensor):  # not an operator on the CPU, a device-to-host copy on a GPU
        counter.counts["tolist"] += 1
        return tolist(tensor)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            app(sys.argv[1:], prog_name="h2o-kv", standalone_mode=False)
    except SystemExit:
        pass
    finally:
        torch.Tensor.tolist = tolist
    total, syncs = sum(counter.counts.values()), counter.counts["_local_scalar_dense"] + counter.counts["tolist"]
    print(f"operators {total}  host syncs {syncs}  seconds {time.perf_counter() - start:.1f}")
    print(", ".join(f"{name} {n}" for name, n in counter.counts.most_common(12)))


if __name__ == "__main__":
    main()
