"""Train the demo model's draft model on the CPU: a small Qwen3-MoE that agrees with the demo's choices.

    label  run the packed demo model (the teacher) over random windows of the train split and over
           windows of the test split; keep its top-8 log-probabilities per position (draft_labels.py)
    train  train the student from those labels (distillation) and/or the corpus, on a wall-clock
           budget; save an HF checkpoint (float32) with the demo's tokenizer; report agreement
    agree  the share of test positions where a checkpoint's argmax equals the teacher's

The student is transformers' Qwen3MoeForCausalLM: the teacher's first layer as it is (attention,
router, 32 experts) and one dense layer after it. The shared layer, the embedding and the head are
the teacher's (dequantized) and stay frozen; the dense layer's attention starts as the teacher's
second layer's; only that layer is trained, to bring the hidden state where the teacher's seven
remaining layers bring it. That is cheap to train on a CPU (no backward through the shared layer)
and cheap to run: one step is one MoE layer, one dense layer and the head.

Losses: `corpus` is next-token cross-entropy on the corpus; `distill` is the cross-entropy against
the teacher's top-8 distribution (renormalized) on the labelled windows; `mix` adds both per step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import draft_labels  # noqa: E402

DEMO = os.path.join(ROOT, "moestream", "demo", "model")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# teacher tensors every student starts from (and the shared layers whole, and the next layer's attention)
SHARED_PREFIXES = ("model.embed_tokens.", "lm_head.", "model.norm.")
FROZEN_PREFIXES = ("model.embed_tokens.", "lm_head.")


def log(msg: str) -> None:
    print(msg, flush=True)


def student_config(teacher_config: dict, shared: int, dense: int, intermediate: int):
    """The teacher's first `shared` layers (MoE, as they are) followed by `dense` dense layers."""
    from transformers import Qwen3MoeConfig

    keep = {k: teacher_config[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                           "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                                           "eos_token_id", "pad_token_id", "bos_token_id", "tie_word_embeddings",
                                           "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
    experts = teacher_config.get("num_experts", teacher_config.get("num_local_experts"))
    return Qwen3MoeConfig(**keep, num_hidden_layers=shared + dense, num_experts=experts,
                          intermediate_size=intermediate, decoder_sparse_step=1,
                          mlp_only_layers=list(range(shared, shared + dense)), router_aux_loss_coef=0.0,
                          output_router_logits=False, attention_bias=False, attention_dropout=0.0,
                          use_sliding_window=False, initializer_range=0.02)


def teacher_tensors(packed_dir: str, shared: int) -> tuple[dict, dict]:
    """(config.json, {name: float32 tensor}) of the packed teacher, dequantized: what the student shares."""
    from safetensors.torch import load_file

    from moestream.convert.export_hf import export_hf

    prefixes = SHARED_PREFIXES + tuple(f"model.layers.{i}." for i in range(shared)) + tuple(
        f"model.layers.{shared}.{part}" for part in ("self_attn.", "input_layernorm.", "post_attention_layernorm."))
    with tempfile.TemporaryDirectory() as tmp:
        hf = export_hf(packed_dir, os.path.join(tmp, "hf"))
        with open(os.path.join(hf, "config.json")) as f:
            config = json.load(f)
        tensors = {}
        for name in sorted(os.listdir(hf)):
            if name.endswith(".safetensors"):
                tensors.update({k: v for k, v in load_file(os.path.join(hf, name)).items() if k.startswith(prefixes)})
    return config, tensors


def fuse_experts(tensors: dict, shared: int) -> dict:
    """Per-expert tensors (as export_hf names them) -> transformers' fused stacks: gate_up_proj
    [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(shared):
        p = f"model.layers.{i}.mlp.experts."
        count = len({k for k in tensors if k.startswith(p) and k.endswith(".down_proj.weight")})
        if count:
            out[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                              tensors[f"{p}{e}.up_proj.weight"]]) for e in range(count)])
            out[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(count)])
    return out


def build_student(packed_dir: str, shared: int, dense: int, intermediate: int, seed: int):
    from transformers import AutoModelForCausalLM

    config, tensors = teacher_tensors(packed_dir, shared)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(student_config(config, shared, dense, intermediate), dtype=torch.float32,
                                             attn_implementation="sdpa", experts_implementation="eager")
    state = model.state_dict()
    tensors = fuse_experts(tensors, shared)
    if dense == 0:  # no layer after the shared ones to start from the teacher's next attention
        tensors = {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{shared}.")}
    for name, value in tensors.items():
        if name not in state or state[name].shape != value.shape:
            raise SystemExit(f"train: the teacher's {name} does not fit the student")
        state[name] = value.float()
    model.load_state_dict(state)
    frozen = FROZEN_PREFIXES + tuple(f"model.layers.{i}." for i in range(shared))
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen))
    return model


def distill_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's top-k distribution, renormalized."""
    target = torch.softmax(top_logp.float(), dim=-1)  # [B, S, K]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, top_ids.long())  # [B, S, K]
    return -(target * logp).sum(-1).mean()


@torch.no_grad()
def agreement(model, labels: draft_labels.Labels, batch: int = 8) -> dict:
    """Teacher-forced: the share of positions where the student's argmax is the teacher's."""
    model.eval()
    same = total = 0
    top2 = 0
    for i in range(0, len(labels.inputs), batch):
        x = torch.from_numpy(labels.inputs[i:i + batch].astype(np.int64))
        logits = model(input_ids=x, use_cache=False).logits
        teacher_top = torch.from_numpy(labels.top_ids[i:i + batch, :, 0].astype(np.int64))
        pred = logits.topk(2, dim=-1).indices
        same += int((pred[..., 0] == teacher_top).sum())
        top2 += int((pred == teacher_top[..., None]).any(-1).sum())
        total += teacher_top.numel()
    model.train()
    return {"top1_agreement": round(same / total, 4), "top2_contains_teacher": round(top2 / total, 4),
            "positions": total}


def cmd_label(args) -> None:
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    engine = draft_labels.teacher(args.model, args.threads)
    test = np.load(os.path.join(args.data, "test.npy"))
    starts = draft_labels.window_starts(len(test), args.seq_len, args.test_windows, seed=args.seed + 1)
    draft_labels.label_windows(engine, test, starts, seq_len=args.seq_len, top_k=args.top_k, log=log).save(
        os.path.join(args.out, "test-labels.npz"))
    train = np.load(os.path.join(args.data, "train.npy"))
    starts = draft_labels.window_starts(len(train), args.seq_len, args.max_windows, seed=args.seed)
    labels = draft_labels.label_windows(engine, train, starts, seq_len=args.seq_len, top_k=args.top_k,
                                        time_budget_s=args.time_budget_s - (time.time() - t0), log=log)
    labels.save(os.path.join(args.out, "train-labels.npz"))
    log(f"label: {labels.inputs.size} train positions, {time.time() - t0:.0f}s")


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))))


def cmd_train(args) -> None:
    wall0 = time.time()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    corpus = np.load(os.path.join(args.data, "train.npy")).astype(np.int64)
    labels = draft_labels.Labels.load(os.path.join(args.labels, "train-labels.npz"))
    test = draft_labels.Labels.load(os.path.join(args.labels, "test-labels.npz"))
    model = build_student(args.model, args.shared_layers, args.dense_layers, args.intermediate, args.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    log(f"student: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{sum(p.numel() for p in trainable) / 1e6:.2f}M trained; loss {args.loss}; "
        f"{labels.inputs.size} labelled positions; threads {args.threads}")
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    start = agreement(model, test)
    log(f"agreement before training: {start}")
    budget = args.time_budget_s - (time.time() - wall0) - args.reserve_s
    t_train0, step, total, recent, curve = time.time(), 0, args.max_steps, [], []
    S = args.seq_len
    while step < total:
        if step in (5, 25):  # fit the cosine schedule into the budget from the measured step time (twice:
            # the first steps on a shared machine may be slower or faster than the rest)
            per_step = (time.time() - t_train0) / step
            total = min(args.max_steps, max(step + 1, int(budget / per_step)))
            log(f"calibration: {per_step:.2f} s/step; {total} steps fit in the budget")
        lr = lr_at(step, total, args.lr, args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = torch.zeros(())
        parts = {}
        if args.loss in ("distill", "mix"):
            idx = rng.integers(0, len(labels.inputs), args.batch_size)
            off = int(rng.integers(0, labels.inputs.shape[1] - S + 1))
            x = torch.from_numpy(labels.inputs[idx, off:off + S].astype(np.int64))
            logits = model(input_ids=x, use_cache=False).logits
            kd = distill_loss(logits, torch.from_numpy(labels.top_ids[idx, off:off + S]),
                              torch.from_numpy(labels.top_logp[idx, off:off + S]))
            loss, parts["distill"] = loss + kd, float(kd.detach())
        if args.loss in ("corpus", "mix"):
            starts = rng.integers(0, len(corpus) - S - 1, args.batch_size)
            w = torch.from_numpy(np.stack([corpus[s:s + S + 1] for s in starts]))
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            loss, parts["corpus"] = loss + ce, float(ce.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        recent.append(parts)
        if step % args.log_every == 0 or step == total:
            mean = {k: round(sum(r[k] for r in recent) / len(recent), 4) for k in recent[0]}
            recent = []
            log(f"step {step}/{total} {mean} lr {lr:.2e} | {time.time() - t_train0:.0f}s")
            curve.append({"step": step, **mean})
    train_s = time.time() - t_train0
    final = agreement(model, test)
    log(f"agreement after training: {final}")
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    for name in COPIED:
        shutil.copy(os.path.join(args.model, name), os.path.join(args.out, name))
    record = {"command": " ".join(sys.argv), "loss": args.loss, "shared_layers": args.shared_layers,
              "dense_layers": args.dense_layers,
              "intermediate": args.intermediate, "steps": step, "batch": f"{args.batch_size}x{S}",
              "train_s": round(train_s, 1), "wall_s": round(time.time() - wall0, 1), "threads": args.threads,
              "labelled_positions": int(labels.inputs.size), "agreement_before": start, "agreement_after": final,
              "torch": torch.__version__, "curve": curve}
    with open(os.path.join(args.out, "training_run.json"), "w") as f:
        json.dump(record, f, indent=1)
    log(f"train: wrote {args.out} in {time.time() - wall0:.0f}s")


def cmd_agree(args) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    print(json.dumps(agreement(model, draft_labels.Labels.load(os.path.join(args.labels, "test-labels.npz")))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    lab = sub.add_parser("label")
    lab.add_argument("--model", default=DEMO)
    lab.add_argument("--data", default="build/demo-data")
    lab.add_argument("--out", default="build/draft-data")
    lab.add_argument("--seq-len", type=int, default=512)
    lab.add_argument("--top-k", type=int, default=8)
    lab.add_argument("--max-windows", type=int, default=600)
    lab.add_argument("--test-windows", type=int, default=16)
    lab.add_argument("--time-budget-s", type=float, default=300.0)
    lab.add_argument("--threads", type=int, default=1)
    lab.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train")
    t.add_argument("--model", default=DEMO, help="the packed teacher (its tokenizer and initial tensors)")
    t.add_argument("--data", default="build/demo-data")
    t.add_argument("--labels", default="build/draft-data")
    t.add_argument("--out", default="build/draft-hf")
    t.add_argument("--loss", choices=["corpus", "distill", "mix"], default="mix")
    t.add_argument("--shared-layers", type=int, default=1, help="the teacher's first layers, copied and frozen")
    t.add_argument("--dense-layers", type=int, default=1, help="trained dense layers after them")
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--max-steps", type=int, default=100000)
    t.add_argument("--time-budget-s", type=float, default=600.0)
    t.add_argument("--reserve-s", type=float, default=30.0, help="kept for the final agreement and saving")
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("agree")
    a.add_argument("checkpoint")
    a.add_argument("--labels", default="build/draft-data")
    a.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    {"label": cmd_label, "train": cmd_train, "agree": cmd_agree}[args.cmd](args)


if __name__ == "__main__":
    main()
