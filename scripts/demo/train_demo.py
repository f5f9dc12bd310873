"""Build moestream's demo model: a small Qwen3-MoE trained on the Python standard library.

    prepare  list the corpus (see corpus.py), train a byte-level BPE tokenizer on the train split,
             write the tokenized splits as uint16 arrays plus the tokenizer into --out.
    train    train the model from those arrays (one GPU, bf16 autocast, AdamW + cosine), stop on a
             wall-clock budget, save a bf16 Hugging Face checkpoint and a JSON record of the run.
    check    load a checkpoint with transformers (the reference), report held-out perplexity on
             the test split and a greedy completion.

The model is transformers' own Qwen3MoeForCausalLM built with `from_config`; only the routed
experts' training forward is replaced by an equivalent grouped matmul that runs in bf16 under
autocast (transformers' version casts activations to the fp32 master weights' dtype).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
EXPECTED_PYTHON = "3.11.7"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# The demo architecture. Hidden and expert widths are multiples of 64 (4-bit groups of 64).
MODEL_DEFAULTS = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    intermediate_size=768,  # unused: every layer is an MoE layer
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    router_aux_loss_coef=0.01,
)


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- prepare


def cmd_prepare(args: argparse.Namespace) -> None:
    import corpus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    version = corpus.python_version()
    if version != EXPECTED_PYTHON and not args.allow_any_python:
        sys.exit(f"prepare: the demo corpus is defined on CPython {EXPECTED_PYTHON}, this is {version} "
                 "(pass --allow-any-python to build a different corpus)")
    root = args.stdlib or corpus.stdlib_dir()
    t0 = time.time()
    files, dropped = corpus.list_corpus(root)
    by_split = {s: [f for f in files if f.split == s] for s in ("train", "val", "test")}
    log(f"corpus: {root} (CPython {version}): {len(files)} files, {sum(f.n_bytes for f in files)} bytes; "
        + ", ".join(f"{s} {len(v)} files/{sum(f.n_bytes for f in v)} bytes" for s, v in by_split.items())
        + f"; dropped {len(dropped)} (not UTF-8 or not parseable)")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in by_split["train"]), trainer=trainer, length=len(by_split["train"]))
    log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()} ({time.time() - t0:.0f}s so far)")

    tok_dir = os.path.join(args.out, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    # Written by hand so that transformers 4.x and 5.x read the same settings.
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": MODEL_DEFAULTS["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=2)

    eos_id = tok.token_to_id(EOS)
    file_rows = []
    split_meta = {}
    for split, items in by_split.items():
        encodings = tok.encode_batch([f.text for f in items])
        parts = []
        for f, enc in zip(items, encodings):
            parts.append(np.asarray(enc.ids + [eos_id], dtype=np.uint16))
            file_rows.append({"path": f.path, "split": split, "sha256": f.sha256, "bytes": f.n_bytes,
                              "tokens": len(enc.ids) + 1})
        arr = np.concatenate(parts)
        path = os.path.join(args.out, f"{split}.npy")
        np.save(path, arr)
        split_meta[split] = {"files": len(items), "bytes": sum(f.n_bytes for f in items),
                             "tokens": int(arr.size), "sha256": sha256_file(path)}
        log(f"{split}: {arr.size} tokens ({split_meta[split]['bytes'] / arr.size:.2f} bytes/token)")
    file_rows.sort(key=lambda r: r["path"])
    meta = {
        "corpus": "Python standard library source (*.py), rules in scripts/demo/corpus.py",
        "python": version,
        "implementation": platform.python_implementation(),
        "stdlib_dir": root,
        "excluded_dirs": list(corpus.EXCLUDED_DIRS) + ["config-*"],
        "excluded_files": ["_sysconfigdata_*.py", "files that are not UTF-8 or fail ast.parse"],
        "split_rule": "int(sha256(relative path)[:8], 16) % 100: 0-4 test, 5-6 val, else train",
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "tokenizer_sha256": sha256_file(os.path.join(tok_dir, "tokenizer.json")),
        "splits": split_meta,
        "dropped": [{"path": p, "reason": r} for p, r in dropped],
        "files": file_rows,
    }
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump(meta, f, indent=1)
    log(f"prepare: wrote {args.out} in {time.time() - t0:.0f}s")


# ----------------------------------------------------------------------------- model


def build_config(vocab_size: int, special: dict, overrides: dict):
    from transformers import Qwen3MoeConfig

    p = dict(MODEL_DEFAULTS, **overrides)
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        moe_intermediate_size=p["moe_intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"],
        num_experts=p["num_experts"],
        num_experts_per_tok=p["num_experts_per_tok"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=p["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"]},
        rms_norm_eps=p["rms_norm_eps"],
        router_aux_loss_coef=p["router_aux_loss_coef"],
        output_router_logits=False,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=special[EOS],
        pad_token_id=special[EOS],
    )


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Same math as transformers' Qwen3MoeExperts; matmuls in the autocast dtype when autocast is on.

    T tokens, K experts per token, S = T*K routed rows, H hidden, I expert width, E experts.
    """
    import torch
    import torch.nn.functional as F

    dev = hidden_states.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.gate_up_proj.dtype
    n_tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)  # [S]
    order = torch.argsort(flat, stable=True)  # [S] rows grouped by expert
    # scatter_add instead of bincount: no host sync on CUDA
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [E]
    x = hidden_states[order // k].to(dtype)  # [S, H]
    gate_up = F.grouped_mm(x, self.gate_up_proj.to(dtype).transpose(1, 2), offs=offs)  # [S, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.grouped_mm(self.act_fn(gate) * up, self.down_proj.to(dtype).transpose(1, 2), offs=offs)  # [S, H]
    y = y.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = y[inverse]  # back to token-major order, [S, H]
    return y.view(n_tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def patch_experts(model) -> int:
    import torch.nn.functional as F

    if not hasattr(F, "grouped_mm"):
        return 0
    n = 0
    for module in model.modules():
        if type(module).__name__ == "Qwen3MoeExperts" and hasattr(module, "gate_up_proj"):
            e, two_i, h = module.gate_up_proj.shape
            if module.down_proj.shape != (e, h, two_i // 2):
                return 0
            module.forward = types.MethodType(grouped_experts_forward, module)
            n += 1
    return n


def count_params(model, cfg) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = experts // (cfg.num_hidden_layers * cfg.num_experts)
    active = total - experts + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    return {"total": total, "routed_experts": experts, "per_expert": per_expert,
            "active_per_token": active, "embedding": cfg.vocab_size * cfg.hidden_size}


def evaluate(model, tokens, *, seq_len: int, batch_size: int, device, amp_dtype=None,
             max_chunks: int | None = None, routing: bool = False) -> dict:
    """Mean next-token loss over `tokens` cut into consecutive windows of seq_len predictions."""
    import torch
    import torch.nn.functional as F

    n_pred = tokens.numel() - 1
    starts = list(range(0, n_pred, seq_len))
    if max_chunks is not None:
        starts = starts[:max_chunks]
    cfg = model.config
    loads = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.float64)
    total_nll, total_n = 0.0, 0
    was_training = model.training
    model.eval()
    full = [s for s in starts if s + seq_len <= n_pred]
    tail = [s for s in starts if s + seq_len > n_pred]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[s] for s in tail]
    with torch.no_grad():
        for group in groups:
            length = min(seq_len, n_pred - group[0])
            idx = torch.tensor(group)[:, None] + torch.arange(length + 1)
            chunk = tokens[idx.to(tokens.device)].to(device=device, dtype=torch.long)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                out = model(input_ids=chunk[:, :-1], output_router_logits=routing, use_cache=False)
            nll = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                  reduction="sum")
            total_nll += float(nll)
            total_n += chunk[:, 1:].numel()
            if routing:
                for layer, logits in enumerate(out.router_logits):
                    top = logits.float().topk(cfg.num_experts_per_tok, dim=-1).indices.reshape(-1)
                    loads[layer] += torch.bincount(top.cpu(), minlength=cfg.num_experts).double()
    model.train(was_training)
    loss = total_nll / max(total_n, 1)
    result = {"loss": loss, "ppl": math.exp(loss), "tokens": total_n}
    if routing:
        share = loads / loads.sum(dim=1, keepdim=True)  # fraction of routed rows per expert
        uniform = 1.0 / cfg.num_experts
        entropy = -(share.clamp_min(1e-12) * share.clamp_min(1e-12).log()).sum(dim=1) / math.log(cfg.num_experts)
        result["routing"] = {
            "max_share_over_uniform": [round(float(v) / uniform, 3) for v in share.max(dim=1).values],
            "min_share_over_uniform": [round(float(v) / uniform, 3) for v in share.min(dim=1).values],
            "normalized_entropy": [round(float(v), 4) for v in entropy],
        }
    return result


# ----------------------------------------------------------------------------- train


def lr_at(step: int, total: int, *, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def cmd_train(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    wall0 = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    amp_dtype = torch.bfloat16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    with open(os.path.join(args.data, "corpus.json")) as f:
        meta = json.load(f)
    arrays = {s: np.load(os.path.join(args.data, f"{s}.npy")) for s in ("train", "val", "test")}
    for s, a in arrays.items():
        if sha256_file(os.path.join(args.data, f"{s}.npy")) != meta["splits"][s]["sha256"]:
            sys.exit(f"train: {s}.npy does not match corpus.json")
    tokens = {s: torch.from_numpy(a.astype(np.int32)).to(device) for s, a in arrays.items()}
    n_train = tokens["train"].numel()

    overrides = {k: getattr(args, k) for k in ("num_hidden_layers", "num_experts", "num_experts_per_tok",
                                                "hidden_size", "moe_intermediate_size") if getattr(args, k)}
    cfg = build_config(meta["vocab_size"], meta["special_tokens"], overrides)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(device)
    n_patched = patch_experts(model)
    params = count_params(model, cfg)
    log(f"model: Qwen3MoeForCausalLM, {params['total'] / 1e6:.2f}M parameters "
        f"({params['routed_experts'] / 1e6:.2f}M in routed experts, {params['active_per_token'] / 1e6:.2f}M active "
        f"per token); experts forward: {'grouped bf16' if n_patched else 'transformers default'}")
    log(f"device: {device} {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    tokens_per_step = args.batch_size * args.seq_len
    planned = args.max_steps or math.ceil(args.epochs * n_train / tokens_per_step)
    total_steps = planned
    sched = dict(peak=args.lr, warmup=min(args.warmup_steps, max(1, planned // 10)), min_ratio=args.min_lr_ratio)
    log(f"data: train {n_train} tokens, val {tokens['val'].numel()}, test {tokens['test'].numel()}; "
        f"batch {args.batch_size}x{args.seq_len} = {tokens_per_step} tokens/step; planned {planned} steps "
        f"({planned * tokens_per_step / n_train:.2f} epochs); time budget {args.time_budget_s:.0f}s")

    # Every step's window starts, drawn up front on the CPU from the seed: no host-device copy per step.
    gen = torch.Generator().manual_seed(args.seed)
    all_starts = torch.randint(0, n_train - args.seq_len - 1, (planned, args.batch_size), generator=gen).to(device)
    offsets = torch.arange(args.seq_len + 1, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def eval_val(routing=False):
        return evaluate(model, tokens["val"], seq_len=args.seq_len, batch_size=args.eval_batch_size,
                        device=device, amp_dtype=amp_dtype, max_chunks=args.eval_max_chunks, routing=routing)

    curve, recent, last_train = [], [], float("nan")
    best = {"loss": float("inf"), "step": -1, "state": None}
    clipped = False
    calib_from, calib_t0 = min(10, planned), None
    model.train()
    sync()
    t_train0 = time.time()
    step = 0
    while step < total_steps:
        if step == calib_from:
            sync()
            calib_t0 = time.time()
        if calib_t0 is not None and step == calib_from + args.calib_steps:
            # Fit the cosine schedule into the wall-clock budget once, early (before warmup ends).
            sync()
            step_time = (time.time() - calib_t0) / args.calib_steps
            evals_left = (total_steps - step) // args.eval_every + 2
            eval_time = 0.5 if not curve else curve[-1]["eval_s"]
            left = args.time_budget_s - (time.time() - wall0) - args.reserve_s - evals_left * eval_time
            fit = step + int(left / step_time)
            log(f"calibration: {step_time * 1000:.1f} ms/step, {tokens_per_step / step_time:,.0f} tok/s; "
                f"{fit} steps fit in the budget")
            if fit < total_steps:
                total_steps, clipped = max(fit, step + 1), True
                log(f"schedule shortened to {total_steps} steps")
        lr = lr_at(step, total_steps, **sched)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = tokens["train"][all_starts[step][:, None] + offsets].long()  # [B, S+1]
        with torch.autocast(device.type, dtype=amp_dtype):
            out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss = ce + cfg.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        recent.append(torch.stack([ce.detach(), out.aux_loss.detach().float(), gnorm.detach().float()]))
        last = step == total_steps
        if step % args.log_every == 0 or last:
            vals = torch.stack(recent).mean(0).tolist()
            recent = []
            elapsed = time.time() - t_train0
            log(f"step {step}/{total_steps} loss {vals[0]:.4f} aux {vals[1]:.4f} gnorm {vals[2]:.2f} "
                f"lr {lr:.2e} | {step * tokens_per_step / elapsed:,.0f} tok/s | {elapsed:.0f}s")
            last_train = vals[0]
        if step % args.eval_every == 0 or last:
            t_e = time.time()
            val = eval_val()
            curve.append({"step": step, "train_loss": round(last_train, 4), "val_loss": round(val["loss"], 4),
                          "eval_s": time.time() - t_e})
            log(f"  val loss {val['loss']:.4f} ppl {val['ppl']:.2f}")
            if val["loss"] < best["loss"]:
                best = {"loss": val["loss"], "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        if time.time() - wall0 > args.time_budget_s - args.reserve_s and not last:
            log(f"time budget reached at step {step}; stopping")
            clipped = True
            if recent:
                last_train = torch.stack(recent).mean(0).tolist()[0]
            if not curve or curve[-1]["step"] != step:
                val = eval_val()
                curve.append({"step": step, "train_loss": round(last_train, 4), "val_loss": round(val["loss"], 4),
                              "eval_s": 0.0})
                if val["loss"] < best["loss"]:
                    best = {"loss": val["loss"], "step": step, "state": None}
            break
    sync()
    train_s = time.time() - t_train0
    if best["state"] is not None and best["step"] != step:
        log(f"restoring the step-{best['step']} weights (val loss {best['loss']:.4f} < {curve[-1]['val_loss']:.4f})")
        model.load_state_dict(best["state"])
    selected = best["step"] if best["state"] is not None else step
    best["state"] = None

    val = eval_val(routing=True)
    test = evaluate(model, tokens["test"], seq_len=args.seq_len, batch_size=args.eval_batch_size, device=device,
                    amp_dtype=amp_dtype, max_chunks=args.eval_max_chunks)
    log(f"held-out: val loss {val['loss']:.4f} ppl {val['ppl']:.2f}; test loss {test['loss']:.4f} "
        f"ppl {test['ppl']:.2f} ({test['tokens']} tokens)")
    log(f"routing (val, per layer): max expert share / uniform {val['routing']['max_share_over_uniform']}, "
        f"normalized entropy {val['routing']['normalized_entropy']}")

    os.makedirs(args.out, exist_ok=True)
    model.eval()
    model.to(torch.bfloat16)
    model.config.output_router_logits = False
    eos, im_end = meta["special_tokens"][EOS], meta["special_tokens"][IM_END]
    model.generation_config = GenerationConfig(eos_token_id=[eos, im_end], pad_token_id=eos, do_sample=False)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    for name in TOKENIZER_FILES:
        src = os.path.join(args.data, "tokenizer", name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(args.out, name))
    sample = greedy_sample(model, os.path.join(args.data, "tokenizer"), args.prompt, 64, device)
    log(f"greedy sample (bf16, {device.type}):\n{sample}")

    record = {
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "norm_topk_prob", "router_aux_loss_coef",
                                                 "max_position_embeddings", "tie_word_embeddings")},
        "parameters": params,
        "data": {"python": meta["python"], "tokenizer_sha256": meta["tokenizer_sha256"],
                 "splits": {s: {k: v for k, v in m.items() if k != "sha256"} for s, m in meta["splits"].items()}},
        "train": {
            "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "tokens_per_step": tokens_per_step, "lr": args.lr, "min_lr_ratio": args.min_lr_ratio,
            "warmup_steps": sched["warmup"], "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
            "betas": [0.9, 0.95], "precision": "fp32 master weights, bf16 autocast",
            "experts_forward": "grouped bf16" if n_patched else "transformers default",
            "planned_steps": planned, "scheduled_steps": total_steps, "steps": step,
            "cut_by_time_budget": clipped, "selected_step": selected,
            "tokens_seen": step * tokens_per_step, "epochs": round(step * tokens_per_step / n_train, 3),
            "train_time_s": round(train_s, 1), "wall_time_s": round(time.time() - wall0, 1),
            "tokens_per_s": round(step * tokens_per_step / train_s),
            "final_train_loss": curve[-1]["train_loss"],
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda" else None,
        },
        "eval": {"val_loss": round(val["loss"], 4), "val_ppl": round(val["ppl"], 3),
                 "test_loss": round(test["loss"], 4), "test_ppl": round(test["ppl"], 3),
                 "test_tokens": test["tokens"], "precision": "bf16 autocast"},
        "routing_val": val["routing"],
        "curve": [{k: v for k, v in c.items() if k != "eval_s"} for c in curve],
        "sample": {"prompt": args.prompt, "greedy": sample},
        "env": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
    }
    with open(os.path.join(args.out, "training_run.json"), "w") as f:
        json.dump(record, f, indent=1)
    log(f"saved {args.out}; wall time {time.time() - wall0:.0f}s")


def greedy_sample(model, tokenizer_dir: str, prompt: str, max_new_tokens: int, device) -> str:
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=False)


# ----------------------------------------------------------------------------- check


def cmd_check(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.time()
    model, info = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        sys.exit(f"check: loading reported {problems}")
    model.eval()
    params = count_params(model, model.config)
    log(f"loaded {args.model} with transformers {transformers.__version__}: {params['total']:,} parameters "
        f"({params['active_per_token']:,} active per token)")
    sample = greedy_sample(model, args.model, args.prompt, args.max_new_tokens, torch.device("cpu"))
    log(f"greedy completion of {args.prompt!r}:\n{sample}\n")
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "parameters": params,
              "prompt": args.prompt, "greedy": sample}
    if args.data:
        test = torch.from_numpy(np.load(os.path.join(args.data, "test.npy")).astype(np.int64))
        ev = evaluate(model, test, seq_len=args.seq_len, batch_size=args.batch_size, device=torch.device("cpu"),
                      max_chunks=args.max_chunks)
        log(f"test split: loss {ev['loss']:.4f} perplexity {ev['ppl']:.3f} over {ev['tokens']} tokens "
            f"(float32 on CPU, windows of {args.seq_len})")
        result["test"] = {"loss": round(ev["loss"], 4), "ppl": round(ev["ppl"], 3), "tokens": ev["tokens"],
                          "seq_len": args.seq_len, "precision": "float32 (bf16 weights), CPU"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    log(f"check done in {time.time() - t0:.0f}s")


# ----------------------------------------------------------------------------- cli


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prepare", help="corpus list, tokenizer, tokenized splits")
    p.add_argument("--out", default="build/demo-data")
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--stdlib", help="stdlib directory (default: this interpreter's)")
    p.add_argument("--allow-any-python", action="store_true")

    t = sub.add_parser("train", help="train and save the checkpoint")
    t.add_argument("--data", default="build/demo-data")
    t.add_argument("--out", default="build/demo-hf")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--epochs", type=float, default=12.0, help="schedule length when --max-steps is not given")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--time-budget-s", type=float, default=420.0, help="wall clock for the whole command")
    t.add_argument("--reserve-s", type=float, default=25.0, help="kept for final evaluation and saving")
    t.add_argument("--calib-steps", type=int, default=20)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--eval-batch-size", type=int, default=64)
    t.add_argument("--eval-max-chunks", type=int, help="limit evaluation windows (quick tests)")
    t.add_argument("--max-shard-size", default="15MB")
    t.add_argument("--prompt", default="def fibonacci(n):")
    for name in ("num_hidden_layers", "num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size"):
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=int, help="architecture override")

    c = sub.add_parser("check", help="load with transformers; perplexity and a greedy completion")
    c.add_argument("--model", default="build/demo-hf")
    c.add_argument("--data", help="prepared data folder: adds the test-split perplexity")
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--max-chunks", type=int)
    c.add_argument("--prompt", default="def fibonacci(n):")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--json")

    args = ap.parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    main()
