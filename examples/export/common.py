"""Shared by the export examples: write a model's torch.export archive (.pt2) and, for tests,
what PyTorch computes with it.

    python examples/export/<model>.py --out DIR [--reference]

writes DIR/<model>.pt2: torch.export.export(model, example inputs).run_decompositions({}),
saved with torch.export.save (torch >= 2.9 writes the PT2 archive spmdx reads). With
--reference it also writes DIR/<model>.reference.json: a batch, PyTorch autograd's loss and
every parameter's gradient at the exported weights, and the losses of 10 steps of
torch.optim.AdamW with gradient clipping and torchtitan's warm-up/linear-decay schedule (the
hyperparameters are in the file), all in float32. With --train-on DUMP it exports nothing: it
trains the model (the weights it would export) as spmdx's defaults train, on the batches `spmdx
run --debug.dump_batches true` wrote to DUMP, and writes the losses to DUMP/pytorch_losses.json.

Plain PyTorch, no downloads: the weights are a seeded random init.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

# Hyperparameters of the reference run (spmdx's defaults: AdamW (0.9, 0.95), eps 1e-8,
# weight decay 0.1, max_norm 1, 2 warm-up steps, then linear decay over the rest).
REFERENCE = {"lr": 8e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0,
             "warmup_steps": 2, "steps": 10}


def lr_factor(c, warmup, steps):
    """torchtitan's linear_warmup_stable_decay for 0-based step c, decay over every step after
    warm-up, as torchtitan v0.2.2 sizes it (torchtitan/components/lr_scheduler.py, commit
    73a0e6979dd1; PR #1284): one virtual stable step, so that the last step's lr is not 0."""
    decay = steps - warmup
    stable = steps + 1 - warmup - decay
    if c < warmup:
        return (c + 1) / warmup
    if c < warmup + stable:
        return 1.0
    return 1.0 - (c + 1 - warmup - stable) / decay


def loss_of(model, takes_labels, tokens, labels):
    if takes_labels:
        return model(tokens, labels)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def adamw_losses(model, takes_labels, batches, steps):
    """The losses of `steps` steps of torch.optim.AdamW on model with REFERENCE's hyperparameters,
    clipping and schedule (over `steps`), step s (0-based) on batches(s) = (tokens, labels)."""
    r = REFERENCE
    params = [p for _, p in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=r["lr"], betas=(r["beta1"], r["beta2"]), eps=r["eps"], weight_decay=r["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: lr_factor(c, r["warmup_steps"], steps))
    losses = []
    for s in range(steps):
        opt.zero_grad()
        step_loss = loss_of(model, takes_labels, *batches(s))
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(params, r["max_norm"])
        opt.step()
        sched.step()
        losses.append(step_loss.item())
    return losses


def train_on(dump, make_model, takes_labels):
    """PyTorch's losses on the global batches spmdx dumped (DUMP/debug/batches/step-N.{tokens,labels}.npy),
    written to DUMP/pytorch_losses.json; REFERENCE's hyperparameters are spmdx's defaults."""
    import numpy as np

    folder = os.path.join(dump, "debug", "batches")
    steps = sum(1 for f in os.listdir(folder) if f.endswith(".tokens.npy"))
    if steps == 0:
        raise SystemExit(f"no batches in {folder}: run spmdx with --debug.dump_batches true")

    def batch(s):
        return tuple(torch.from_numpy(np.load(os.path.join(folder, f"step-{s + 1}.{what}.npy"))) for what in ("tokens", "labels"))

    torch.manual_seed(0)  # as main(): the weights it exports
    losses = adamw_losses(make_model(), takes_labels, batch, steps)
    with open(os.path.join(dump, "pytorch_losses.json"), "w") as f:
        json.dump({"losses": losses}, f)
    print(f"{steps} PyTorch AdamW steps on {folder}: losses {losses}")


def main(name, make_model, takes_labels, batch, seq, vocab):
    ap = argparse.ArgumentParser(description=f"Write {name}.pt2 (torch.export) for spmdx")
    ap.add_argument("--out", default=".", help="folder to write into")
    ap.add_argument("--reference", action="store_true", help="also write PyTorch's loss, gradients and 10 AdamW steps")
    ap.add_argument("--dynamic-batch", action="store_true", help="export with a dynamic batch dim (spmdx refuses it: for tests)")
    ap.add_argument("--training-ir", action="store_true",
                    help="also write <model>.training_ir.pt2: export() as is, without run_decompositions({})")
    ap.add_argument("--train-on", metavar="DUMP",
                    help="export nothing: train the model with PyTorch on the batches `spmdx run --debug.dump_batches true` wrote to DUMP "
                    "(spmdx's default hyperparameters) and write DUMP/pytorch_losses.json")
    args = ap.parse_args()
    if args.train_on:
        return train_on(args.train_on, make_model, takes_labels)
    os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    example = (tokens, labels) if takes_labels else (tokens,)
    dynamic = None
    if args.dynamic_batch:
        b = torch.export.Dim("batch", min=2, max=64)
        dynamic = tuple({0: b} for _ in example)
    raw = torch.export.export(model, example, dynamic_shapes=dynamic)
    if args.training_ir:
        torch.export.save(raw, os.path.join(args.out, f"{name}.training_ir.pt2"))
    ep = raw.run_decompositions({})
    path = os.path.join(args.out, f"{name}.pt2")
    torch.export.save(ep, path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"inputs {', '.join(f'{list(t.shape)}' for t in example)}")
    if not args.reference:
        return

    r = dict(REFERENCE)
    model.zero_grad()
    loss = loss_of(model, takes_labels, tokens, labels)
    loss.backward()
    grads = {n: p.grad.flatten().tolist() for n, p in model.named_parameters()}
    losses = adamw_losses(model, takes_labels, lambda s: (tokens, labels), r["steps"])
    r.update({"tokens": tokens.flatten().tolist(), "labels": labels.flatten().tolist(), "batch": batch, "seq": seq,
              "loss": loss.item(), "grads": grads, "losses": losses,
              "parameters": [n for n, _ in model.named_parameters()]})
    with open(os.path.join(args.out, f"{name}.reference.json"), "w") as f:
        json.dump(r, f)
