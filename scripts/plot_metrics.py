"""Draws the metrics of spmdx runs into one PNG (scripts/plot is the command).

    scripts/plot RUN [RUN ...] [-o OUT.png]

RUN is a run's folder (job.dump_folder, which holds metrics.jsonl) or a metrics.jsonl itself.
Five panels against the step: loss (val_loss as dots at the steps that validated), learning
rate, gradient norm, tokens/s, and peak memory (peak_mem_bytes, as the allocator counts it;
planned_peak_mem_bytes dashed). Several runs are overlaid, one colour each, labelled by their
folder. A row's value that is null (spmdx writes a NaN loss so) leaves a gap; a row without
"step" and without any metric (a marker between runs) is passed over; where the steps go back
(a run resumed from an earlier checkpoint, its history kept), the line starts again.

Exit status 0 with the PNG written (default: metrics.png in the current folder); 1 with a
message naming the file, and the line, for a missing, empty or garbled metrics.jsonl; 2 for
bad arguments.
"""
import argparse
import json
import math
import os
import sys
import tempfile

METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes", "planned_peak_mem_bytes")


class PlotError(Exception):
    pass


def metrics_file(run):
    """The metrics.jsonl of RUN (a folder or the file itself)."""
    if os.path.isdir(run):
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.exists(path):
            raise PlotError(f"{path}: no such file: is {run} a run's folder (its job.dump_folder)? A run writes metrics.jsonl there from its first step")
        return path
    if not os.path.exists(run):
        raise PlotError(f"{run}: no such file or folder: give a run's folder (its job.dump_folder) or its metrics.jsonl")
    return run


def cut(text, most=60):
    return text if len(text) <= most else text[: most - 3] + "..."


def shown(value):
    """A JSON value as the file has it (strings quoted), cut short."""
    return cut(json.dumps(value))


def read_rows(path):
    """The rows of a metrics.jsonl: (line number, step, {metric: float or None}). Raises
    PlotError naming the file and the line for a row that is not what spmdx writes."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: not a regular file: give a run's folder or its metrics.jsonl")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PlotError(f"{path}: cannot read it: {e.strerror}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise PlotError(f"{path}:{line}: not UTF-8 text (byte {e.start}): the file is damaged")
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path}:{number}: not a JSON row ({e.msg} at column {e.colno}): {cut(line)}")
        if not isinstance(row, dict):
            raise PlotError(f"{path}:{number}: a row is a JSON object, not {shown(row)}")
        if "step" not in row:
            if any(k in row for k in METRICS):
                raise PlotError(f"{path}:{number}: the row has metrics but no \"step\": {cut(line)}")
            continue  # a marker between runs
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise PlotError(f"{path}:{number}: \"step\" is {shown(step)}, not a whole number")
        values = {}
        for key in METRICS:
            if key not in row or row[key] is None:
                continue
            v = row[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise PlotError(f"{path}:{number}: \"{key}\" is {shown(v)}, not a number")
            values[key] = float(v)
        rows.append((number, step, values))
    if not rows:
        raise PlotError(f"{path}: empty: no step's row in it (the run stopped before its first step, or wrote elsewhere)")
    return rows


def labels_of(runs):
    """Each run's label: its folder's name, or as much of its path as tells it from the others."""
    folders = [os.path.abspath(r if os.path.isdir(r) else os.path.dirname(r) or ".") for r in runs]
    parts = [f.rstrip(os.sep).split(os.sep) for f in folders]
    depth = 1
    while depth < max(len(p) for p in parts):
        names = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            break
        depth += 1
    names = [os.sep.join(p[-depth:]) or os.sep for p in parts]
    seen = {}
    out = []
    for n in names:  # the same folder twice: numbered
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def segments(rows, key):
    """(steps, values) runs of `key`, cut where the steps go back (a resumed run's history)."""
    out, steps, values, last = [], [], [], None
    for _, step, vals in rows:
        if last is not None and step <= last and steps:
            out.append((steps, values))
            steps, values = [], []
        last = step
        if key in vals:
            steps.append(step)
            values.append(vals[key])
        else:
            steps.append(step)
            values.append(math.nan)
    if steps:
        out.append((steps, values))
    return [(s, v) for s, v in out if any(not math.isnan(x) for x in v)]


def draw(runs, labels, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = [read_rows(metrics_file(r)) for r in runs]
    peak = max((v.get(k, 0) for rows in all_rows for _, _, v in rows for k in ("peak_mem_bytes", "planned_peak_mem_bytes")), default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    panels = [
        ("loss", "loss", "linear"),
        ("lr", "learning rate", "linear"),
        ("grad_norm", "gradient norm", "log"),
        ("tokens_per_s", "tokens/s", "linear"),
        ("peak_mem_bytes", f"peak memory ({unit})", "linear"),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    axes = axes.flatten()
    for i, (rows, label) in enumerate(zip(all_rows, labels)):
        colour = f"C{i % 10}"
        for ax, (key, title, yscale) in zip(axes, panels):
            factor = 1 / scale if key == "peak_mem_bytes" else 1
            for n, (steps, values) in enumerate(segments(rows, key)):
                ax.plot(steps, [v * factor for v in values], color=colour, linewidth=1.3, label=label if n == 0 and key == "loss" else None)
            if key == "loss":
                for steps, values in segments(rows, "val_loss"):
                    ax.plot(steps, values, "o", color=colour, markersize=4)
            if key == "peak_mem_bytes":
                for steps, values in segments(rows, "planned_peak_mem_bytes"):
                    ax.plot(steps, [v * factor for v in values], "--", color=colour, linewidth=1)
    for ax, (key, title, yscale) in zip(axes, panels):
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if yscale == "log" and any(line.get_ydata().size for line in ax.get_lines()):
            positive = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
            if positive:
                ax.set_yscale("log")
    legend = axes[5]
    legend.axis("off")
    handles, names = axes[0].get_legend_handles_labels()
    notes = [
        matplotlib.lines.Line2D([], [], color="0.3", marker="o", linestyle="none", markersize=4, label="val_loss (loss panel)"),
        matplotlib.lines.Line2D([], [], color="0.3", linestyle="--", label="planned peak (memory panel)"),
    ]
    legend.legend(handles + notes, names + [h.get_label() for h in notes], loc="center", fontsize=10, title="runs")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(output))
    fd, partial = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=folder)
    os.close(fd)
    try:
        fig.savefig(partial, dpi=100, format="png")
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(
        prog="scripts/plot",
        description="Draws loss, learning rate, gradient norm, tokens/s and peak memory of spmdx runs (their metrics.jsonl) into one PNG.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run's folder (job.dump_folder) or its metrics.jsonl; several are overlaid")
    parser.add_argument("-o", "--output", default="metrics.png", help="the PNG to write (default: metrics.png here)")
    args = parser.parse_args(argv)
    if not args.output.lower().endswith(".png"):
        parser.error(f"-o {args.output}: give a .png file")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        print(f"plot: -o {args.output}: no folder {folder}", file=sys.stderr)
        return 1
    if os.path.isdir(args.output):
        print(f"plot: -o {args.output} is a folder: give a .png file", file=sys.stderr)
        return 1
    try:
        for run in args.runs:
            metrics_file(run)  # every missing one said before any drawing
        draw(args.runs, labels_of(args.runs), args.output)
    except PlotError as e:
        print(f"plot: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(args.runs)} run{'s' if len(args.runs) != 1 else ''}: {', '.join(labels_of(args.runs))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
