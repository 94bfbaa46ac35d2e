"""The tables and the plot of ``h2o-kv bench serve`` (:mod:`.serve` measures): one line per setting, the
comparison of one invocation's settings (the transformers backend's ``h2o-kv bench run`` rows alongside) or, for
XSUM, ROUGE paired against the first setting, and the timeline plot."""

from __future__ import annotations

import json
from pathlib import Path

from ..harness.tables import markdown, paired


def one_line(data: dict) -> str:
    """One setting's result in a line (its progress message)."""
    if "rouge2" in data.get("metrics", {}):
        m = data["metrics"]
        return f"ROUGE-1/2/L {m['rouge1']:.4f}/{m['rouge2']:.4f}/{m['rougeL']:.4f} (n={data['n']})"
    m = data["metrics"]
    step = data.get("decode_step_ms")
    return (f"{m['output_throughput']:.1f} out tok/s, {m['request_throughput']:.3f} req/s, max running "
            f"{data['max_running']:.0f}, TPOT p50 {m.get('median_tpot_ms', float('nan')):.1f} ms"
            + (f", decode step p50 {step['p50']:.1f} ms" if step else ""))  # fmt: skip


def transformers_rows(path: Path) -> list[dict]:
    """Rows for the table from an ``h2o-kv bench run`` results file (the transformers backend)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for rec in data["records"]:
        cfg = rec["config"]
        label = cfg["policy"] + (f"@{cfg['budget']:g}" if cfg.get("budget") else "")
        rows.append({
            "setting": label, "backend": "transformers (h2o-kv bench run)", "running": cfg["batch"],
            "out_tok_s": rec.get("e2e_tok_s"), "req_s": None, "ttft": (rec.get("prefill_s"), None),
            "tpot": (rec.get("step_ms_p50"), rec.get("step_ms_p99")), "step": rec.get("step_ms_p50"),
            "preemptions": None, "rss": rec.get("decode_peak_bytes"),
        })  # fmt: skip
    return rows


def vllm_row(data: dict) -> dict:
    m = data.get("metrics", {})
    step = data.get("decode_step_ms") or {}
    return {
        "setting": data["setting"], "backend": "vLLM (h2o-kv serve)",
        "running": data.get("max_running"), "mean_running": data.get("mean_running_while_busy"),
        "out_tok_s": m.get("output_throughput"), "req_s": m.get("request_throughput"),
        "ttft": (_s(m.get("median_ttft_ms")), _s(m.get("p99_ttft_ms"))),
        "tpot": (m.get("median_tpot_ms"), m.get("p99_tpot_ms")), "step": step.get("p50"),
        "preemptions": data.get("preemptions"), "rss": data.get("peak_rss_bytes"),
    }  # fmt: skip


def _s(ms):
    return None if ms is None else ms / 1000


def _f(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def comparison_table(results: list[dict], extra_rows: list[dict] = ()) -> str:
    """The markdown table of one invocation: throughput rows (ratios against the first vLLM setting) or, for XSUM,
    ROUGE with paired 95% intervals against the first setting."""
    if results and "rouge2" in results[0].get("metrics", {}):
        return xsum_table(results)
    rows = [vllm_row(r) for r in results] + list(extra_rows)
    base = rows[0]
    header = ["setting", "backend", "requests at once (max / mean)", "output tok/s", "vs first", "req/s",
              "TTFT p50 / p99 s", "TPOT p50 / p99 ms", "decode step p50 ms", "preemptions", "peak RSS GiB"]  # fmt: skip
    table = []
    for row in rows:
        ratio = row["out_tok_s"] / base["out_tok_s"] if row["out_tok_s"] and base["out_tok_s"] else None
        table.append([
            row["setting"], row["backend"], f"{_f(row['running'], '.0f')} / {_f(row.get('mean_running'))}",
            _f(row["out_tok_s"]), _f(ratio, ".2f") + ("x" if ratio else ""), _f(row["req_s"], ".3f"),
            f"{_f(row['ttft'][0], '.2f')} / {_f(row['ttft'][1], '.2f')}",
            f"{_f(row['tpot'][0])} / {_f(row['tpot'][1])}", _f(row["step"]), _f(row["preemptions"], ".0f"),
            _f(row["rss"] / 2**30 if row["rss"] else None, ".2f"),
        ])  # fmt: skip
    return "\n".join(markdown(header, table))


def xsum_table(results: list[dict]) -> str:
    base = results[0]
    header = ["setting", "n", "ROUGE-1", "ROUGE-2", "ROUGE-L", "ROUGE-2 vs first (paired, 95%)",
              "ROUGE-L vs first (paired, 95%)"]  # fmt: skip
    table = []
    for r in results:
        m, cells = r["metrics"], []
        for name in ("rouge2", "rougeL"):
            if r is base:
                cells.append("-")
            else:
                cells.append(paired(r["items"][name], base["items"][name]).format(100, 2, sign=True, interval=True))
        table.append([r["setting"], str(r["n"]), f"{100 * m['rouge1']:.2f}", f"{100 * m['rouge2']:.2f}",
                      f"{100 * m['rougeL']:.2f}", *cells])  # fmt: skip
    return "\n".join(markdown(header, table))


def plot(results: list[dict], path: Path, title: str) -> Path:
    """Running requests and KV-cache usage over time, one line per setting (output tok/s in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for r in results:
        line = r.get("timeline") or {}
        busy = [t for t, running in zip(line.get("t", []), line.get("running", []), strict=True) if running]
        if not busy:
            continue
        t = [x - busy[0] for x in line["t"]]  # from the first running request (the load generator starts first)
        tok_s = r.get("metrics", {}).get("output_throughput")
        label = r["setting"] + (f" ({tok_s:.1f} out tok/s)" if tok_s else "")
        top.plot(t, line["running"], label=label)
        bottom.plot(t, [100 * v for v in line["kv_usage"]], label=r["setting"])
    top.set_ylabel("requests running")
    bottom.set_ylabel("KV-cache usage (%)")
    bottom.set_xlabel("seconds since the first request started running")
    top.legend()
    top.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
