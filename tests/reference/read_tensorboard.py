#!/usr/bin/env python3
"""Reads a folder of TensorBoard event files with TensorBoard's own reader, as TensorBoard shows it.

    read_tensorboard.py FOLDER                         # prints every scalar as JSON
    read_tensorboard.py FOLDER --expect EXPECTED.json  # ... and checks them against EXPECTED

Prints {"tag": {"step": value, ...}, ...} (steps as strings, as JSON keys must be; tags and steps
sorted; non-finite values as the strings "NaN", "Infinity", "-Infinity", so the output is strict
JSON). FOLDER is one run: the event files directly in it (torch.utils.tensorboard.SummaryWriter's
log_dir, spmdx's metrics.save_tb_folder), read by
tensorboard.backend.event_processing.event_accumulator.EventAccumulator with every scalar kept
(no sampling) and its default handling of restarts (events of steps at or after a step that
comes again are dropped, as TensorBoard drops them).

EXPECTED.json has the same form (values as numbers, or the strings above). For each tag in it,
the run must hold that tag with exactly its steps, each value equal within --rtol (default 1e-6,
a few float32 ulps: TensorBoard keeps scalars as float32); tags the run holds beyond it are
ignored. Every difference is printed to stderr, one line each.

Exit status: 0 read (and, with --expect, matched); 1 a mismatch; 2 no event files or an
unreadable one; 77 the `tensorboard` package is missing (scripts/setup installs it).
"""
import argparse
import json
import math
import os
import sys

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def to_json_value(v):
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return v


def from_json_value(v):
    if isinstance(v, str):
        if v not in NONFINITE:
            raise ValueError(f"not a number: {v!r}")
        return NONFINITE[v]
    return float(v)


def read_scalars(folder):
    """{tag: {step: value}} of the event files directly in `folder`."""
    from tensorboard.backend.event_processing import event_accumulator

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    if not any("tfevents" in name for name in os.listdir(folder)):
        raise FileNotFoundError(f"{folder}: no event files (events.out.tfevents.*) in it")
    acc = event_accumulator.EventAccumulator(folder, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in sorted(acc.Tags()[event_accumulator.SCALARS]):
        out[tag] = {str(e.step): e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.step)}
    return out


def differences(scalars, expected, rtol):
    """One line per difference between what the run holds and `expected`."""
    out = []
    for tag, steps in sorted(expected.items()):
        if tag not in scalars:
            out.append(f"tag {tag!r}: missing (the run has {sorted(scalars) or 'no scalars'})")
            continue
        have = scalars[tag]
        for step in sorted(set(steps) - set(have), key=int):
            out.append(f"tag {tag!r} step {step}: missing")
        for step in sorted(set(have) - set(steps), key=int):
            out.append(f"tag {tag!r} step {step}: not expected (value {have[step]!r})")
        for step in sorted(set(have) & set(steps), key=int):
            want, got = from_json_value(steps[step]), have[step]
            same = (math.isnan(want) and math.isnan(got)) or want == got or math.isclose(got, want, rel_tol=rtol, abs_tol=0.0)
            if not same:
                out.append(f"tag {tag!r} step {step}: {got!r} where {want!r} was expected")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder of event files (one run)")
    parser.add_argument("--expect", metavar="JSON", help="a file of expected values: {tag: {step: value}}")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance of --expect (default 1e-6)")
    args = parser.parse_args()
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print("the Python package `tensorboard` is missing (scripts/setup installs it)", file=sys.stderr)
        return 77
    try:
        scalars = read_scalars(args.folder)
    except (OSError, ValueError) as e:
        print(f"read_tensorboard: {e}", file=sys.stderr)
        return 2
    print(json.dumps({t: {s: to_json_value(v) for s, v in steps.items()} for t, steps in scalars.items()},
                     indent=1, allow_nan=False))
    if args.expect is None:
        return 0
    with open(args.expect) as f:
        expected = json.load(f)
    diffs = differences(scalars, expected, args.rtol)
    for d in diffs:
        print(f"read_tensorboard: {d}", file=sys.stderr)
    if diffs:
        print(f"read_tensorboard: {len(diffs)} difference(s) between {args.folder} and {args.expect}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
