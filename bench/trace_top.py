#!/usr/bin/env python3
"""Where a profiled step's time went: the GPU kernels (or, without any, the CPU ops) of a Kineto
trace that `[profiling]` wrote (Chrome trace JSON, `<dump>/profile_traces/iteration_N/rankR_trace.json`),
summed by name, the largest first, with each one's share of the summed time and its call count.
Kernel names are cut to 110 characters (templates make them long). Standard library only.

    bench/trace_top.py TRACE.json [--top 20] [--cpu | --by-op]

--cpu sums the CPU ops even where there are kernels; CPU ops nest (aten::linear holds aten::mm),
so their times are inclusive and add up to more than the span. --by-op sums the GPU kernels by
the spmdx op (the "spmdx compute" track's span) whose host thread launched them, found through
each kernel's launch (the CUDA runtime or driver event with its correlation id: cuBLAS's
GEMMs launch through the driver, cuLaunchKernelEx).
"""
import argparse
import bisect
import collections
import json
import sys


def by_op(complete, kernels):
    """Each kernel's name replaced by the spmdx op whose span holds its launch ("(outside an op)" else)."""
    launch = {e["args"]["correlation"]: e["ts"] for e in complete
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in complete if e.get("cat") == "spmdx" and e.get("tid") == "spmdx compute")
    starts = [s[0] for s in spans]
    out = []
    for k in kernels:
        t = launch.get((k.get("args") or {}).get("correlation"))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        op = spans[i][2] if i >= 0 and spans[i][0] <= t <= spans[i][1] else "(outside an op)"
        out.append(dict(k, name=op))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="sum the CPU ops (cat cpu_op), not the GPU kernels")
    ap.add_argument("--by-op", action="store_true", help="sum the GPU kernels by the spmdx op that launched them")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            events = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"{args.trace}: cannot read a Chrome trace: {e}")
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    kernels = [] if args.cpu else [e for e in complete if e.get("cat") == "kernel"]
    what = "GPU kernels" if kernels else "CPU ops"
    chosen = kernels or [e for e in complete if e.get("cat") == "cpu_op"]
    if args.by_op and kernels:
        chosen, what = by_op(complete, kernels), "GPU kernels by spmdx op"
    if not chosen:
        sys.exit(f"{args.trace}: no kernel or cpu_op events")
    total, count = collections.Counter(), collections.Counter()
    for e in chosen:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    span = (max(e["ts"] + e["dur"] for e in chosen) - min(e["ts"] for e in chosen)) / 1e3
    summed = sum(total.values()) / 1e3
    print(f"{what}: {summed:.1f} ms summed over {sum(count.values())} calls, in a span of {span:.1f} ms ({100 * summed / span:.0f}% busy)")
    for name, us in total.most_common(args.top):
        print(f"{us / 1e3:9.2f} ms {100 * us / 1e3 / summed:5.1f}% {count[name]:6d}x  {name[:110]}")


if __name__ == "__main__":
    main()
