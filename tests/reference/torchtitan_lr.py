#!/usr/bin/env python3
"""torchtitan's learning-rate schedule, as torchtitan v0.2.2 computes it, for spmdx's tests.

Written from torchtitan/components/lr_scheduler.py at tag v0.2.2 (commit 73a0e6979dd1, 2026-02-20;
the schedule of its PR #1284, 2025-06-11, with `total_steps` from PR #2340; unchanged at HEAD):
build_lr_schedulers() sizes the phases (warm-up cut to the total, decay cut to the steps after
warm-up, one virtual stable step so that the last lr is not 0) and linear_warmup_stable_decay()
gives LambdaLR's factor. The factors are read the way torchtitan's training loop sees them: a
real torch.optim.lr_scheduler.LambdaLR over an optimizer with lr 1, get_last_lr() before each
optimizer step, scheduler.step() after it. Nothing here is spmdx's.

    torchtitan_lr.py '[{"steps": 10, "warmup_steps": 5, "decay_ratio": null, "decay_type": "linear",
                        "min_lr_factor": 0.0, "total_steps": null}, ...]'

prints a JSON list, for each case, of the factor of steps 1..steps (training.steps).
"""
import functools
import json
import math
import sys
import warnings

import torch


def build_lr_lambda(training_steps, warmup_steps, decay_ratio, decay_type, min_lr_factor, total_steps):
    # build_lr_schedulers(), v0.2.2 (its logger.warning()s become warnings here).
    total_steps = total_steps if total_steps is not None else training_steps
    warmup_steps = int(warmup_steps)
    if warmup_steps > total_steps:
        warnings.warn(f"Warmup steps ({warmup_steps}) exceed total steps ({total_steps}). Adjusting warmup steps to {total_steps}.")
        warmup_steps = total_steps
    if decay_ratio is not None:
        decay_steps = round(total_steps * decay_ratio)
        if warmup_steps + decay_steps > total_steps:
            warnings.warn(f"Warmup ({warmup_steps}) + decay ({decay_steps}) steps exceed total steps ({total_steps}).")
            decay_steps = total_steps - warmup_steps
    else:
        decay_steps = total_steps - warmup_steps
    # Add a virtual last step to prevent the learning rate from dropping to 0
    stable_steps = total_steps + 1 - warmup_steps - decay_steps

    def linear_warmup_stable_decay(current_step, warmup_steps, stable_steps, decay_steps, lr_decay_type, min_lr_factor):
        warmup_stable_steps = warmup_steps + stable_steps
        if current_step < warmup_steps:
            current_step += 1
            assert warmup_steps != 0, "warmup_steps must not be zero to reach this branch"
            curr_adjustment = float(current_step / warmup_steps)
        elif current_step < warmup_stable_steps:
            curr_adjustment = 1.0
        else:
            current_step += 1
            assert decay_steps != 0, "decay_steps must not be zero to reach this branch"
            progress = float(current_step - warmup_stable_steps) / decay_steps
            if lr_decay_type == "linear":
                curr_adjustment = 1 - progress
            elif lr_decay_type == "sqrt":
                curr_adjustment = 1 - math.sqrt(progress)
            elif lr_decay_type == "cosine":
                curr_adjustment = 0.5 * (1.0 + math.cos(math.pi * progress))
            else:
                raise ValueError(f"Unknown lr_decay_type: {lr_decay_type}")
            curr_adjustment = min_lr_factor + (1 - min_lr_factor) * curr_adjustment
        return curr_adjustment

    return functools.partial(linear_warmup_stable_decay, warmup_steps=warmup_steps, stable_steps=stable_steps, decay_steps=decay_steps,
                             lr_decay_type=decay_type, min_lr_factor=min_lr_factor)


def factors(case):
    """The factor of each step 1..case["steps"] as torchtitan's loop applies it."""
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, build_lr_lambda(case["steps"], case["warmup_steps"], case.get("decay_ratio"), case.get("decay_type", "linear"),
                             case.get("min_lr_factor", 0.0), case.get("total_steps")))
    out = []
    for _ in range(case["steps"]):
        out.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    return out


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print(json.dumps([factors(c) for c in json.loads(sys.argv[1])]))
