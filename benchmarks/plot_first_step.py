"""Plot first_step.py's JSON files as ratios to each scenario's baseline: one panel per TF.

    pip install 'safestrategy[bench]'     # or just: pip install matplotlib
    python benchmarks/plot_first_step.py benchmarks/results/*.json -o docs/first_step.png

A bar is a candidate's median over its scenario's baseline median; the whisker
spans the candidate's quartiles over that same median; the dashed line is the
target (green: met, red: not; grey: no target, e.g. the cold probe process): today's,
from first_step.py (as its ``--table`` prints them), not the one a file was written with.
"""

import argparse
import json
from typing import Any, Dict, List, Sequence

import matplotlib.pyplot as plt
from first_step import SCENARIOS, quantile, targets  # this script's folder is on sys.path


def bars(record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One bar per candidate: its label, ratio, quartile ratios and target (None: none)."""
    seconds = {name: [r["seconds"] for r in runs] for name, runs in record["runs"].items()}
    known = {scenario.name: scenario for scenario in SCENARIOS}
    rows = []
    for scenario in record["scenarios"]:
        base = quantile(seconds[scenario["baseline"]], 0.5)
        goals = scenario["targets"]
        if scenario["name"] in known:
            goals = targets(known[scenario["name"]], record["tf"])
        for name, target in zip(scenario["candidates"], goals):
            times = seconds[name]
            rows.append(
                {
                    "label": f"{scenario['name']}\n{name}",
                    "ratio": quantile(times, 0.5) / base,
                    "low": quantile(times, 0.25) / base,
                    "high": quantile(times, 0.75) / base,
                    "target": target,
                }
            )
    return rows


def plot(records: Sequence[Dict[str, Any]], out: str) -> None:
    figure, axes = plt.subplots(
        1, len(records), figsize=(6 * len(records), 4.5), sharex=True, squeeze=False
    )
    for axis, record in zip(axes[0], records):
        rows = bars(record)
        y = list(range(len(rows)))[::-1]
        ratios = [row["ratio"] for row in rows]
        errors = [
            [row["ratio"] - row["low"] for row in rows],
            [row["high"] - row["ratio"] for row in rows],
        ]
        colors = [
            "tab:grey"
            if r["target"] is None
            else "tab:green"
            if r["ratio"] <= r["target"]
            else "tab:red"
            for r in rows
        ]
        axis.barh(y, ratios, xerr=errors, color=colors, alpha=0.8, capsize=4)
        for row, row_y in zip(rows, y):
            if row["target"] is not None:
                axis.vlines(row["target"], row_y - 0.45, row_y + 0.45, "black", "dashed")
        for row, row_y in zip(rows, y):
            axis.text(row["high"] + 0.03, row_y, f"{row['ratio']:.2f}x", va="center", fontsize=9)
        axis.axvline(1.0, color="grey", linewidth=1)
        axis.set_yticks(y)
        axis.set_yticklabels([row["label"] for row in rows], fontsize=9)
        axis.set_title(
            f"TF {record['tf']} (Python {record['python']}), median of {record['repeat']}"
        )
        axis.set_xlabel("time to first trained step / baseline")
    figure.suptitle(
        "make_mirrored_strategy() vs stock or the same backend by hand:\n"
        "fresh-process time to the first trained Keras step (dashed: target)"
    )
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="files written by first_step.py --json")
    parser.add_argument("-o", "--out", default="docs/first_step.png")
    args = parser.parse_args()
    records = []
    for path in args.json:
        with open(path) as stream:
            records.append(json.load(stream))
    plot(sorted(records, key=lambda r: r["tf"], reverse=True), args.out)


if __name__ == "__main__":
    main()
