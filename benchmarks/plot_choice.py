"""Plot allreduce.py and steady_step.py JSON files as ratios to the fastest: one panel per file.

    pip install 'safestrategy[bench]'     # or just: pip install matplotlib
    python benchmarks/plot_choice.py benchmarks/results/allreduce-*.json \\
        benchmarks/results/steady_step-*.json -o docs/choice.png

A bar is a variant's median over the fastest variant's median at that device count
(all-reduce: the median over processes of each process's median over rounds; step:
the median over rounds). Orange: what ``auto`` uses (the chosen backend, or
``make_mirrored_strategy``); the dashed line is the 1.03x target.
"""

import argparse
import json
import statistics
from typing import Any, Dict, List, Sequence

import matplotlib.pyplot as plt
from allreduce import STOCK, medians  # this script's folder is on sys.path
from steady_step import AUTO

TARGET = 1.03


def bars(record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One bar per device count and variant: label, ratio to the fastest, whether auto's."""
    rows = []
    for cpus, runs in record["runs"].items():
        if record["kind"] == "allreduce":
            figures, chosen = medians(runs), runs[0]["chosen"]
        else:
            figures = {label: statistics.median(t) for label, t in runs["times"].items()}
            chosen = AUTO
        fastest = min(figures.values())
        for label, value in sorted(figures.items(), key=lambda pair: pair[1]):
            short = "stock" if label == STOCK else label
            label_text = f"{cpus} CPUs  {short}"
            rows.append({"label": label_text, "ratio": value / fastest, "auto": label == chosen})
    return rows


def title(record: Dict[str, Any]) -> str:
    if record["kind"] == "allreduce":
        return (
            f"all-reduce of a {record['payload_mb']:g} MB payload, TF {record['tf']}\n"
            f"{record['rounds']} interleaved rounds x {record['processes']} process(es)"
        )
    return (
        f"Keras steady-state step, TF {record['tf']}\n"
        f"MLP width {record['width']}, {record['rounds']} interleaved rounds"
    )


def plot(records: Sequence[Dict[str, Any]], out: str) -> None:
    figure, axes = plt.subplots(1, len(records), figsize=(6 * len(records), 5), squeeze=False)
    for axis, record in zip(axes[0], records):
        rows = bars(record)
        y = list(range(len(rows)))[::-1]
        colors = ["tab:orange" if row["auto"] else "tab:blue" for row in rows]
        axis.barh(y, [row["ratio"] for row in rows], color=colors, alpha=0.8)
        for row, row_y in zip(rows, y):
            axis.text(row["ratio"] + 0.02, row_y, f"{row['ratio']:.2f}x", va="center", fontsize=9)
        axis.axvline(1.0, color="grey", linewidth=1)
        axis.axvline(TARGET, color="black", linestyle="dashed", linewidth=1)
        axis.set_yticks(y)
        axis.set_yticklabels([row["label"] for row in rows], fontsize=9)
        axis.set_title(title(record), fontsize=10)
        axis.set_xlabel("median / fastest median (orange: what auto uses)")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="files written by allreduce.py/steady_step.py")
    parser.add_argument("-o", "--out", default="docs/choice.png")
    args = parser.parse_args()
    records = []
    for path in args.json:
        with open(path) as stream:
            records.append(json.load(stream))
    plot(sorted(records, key=lambda r: (r["kind"], r["tf"])), args.out)


if __name__ == "__main__":
    main()
