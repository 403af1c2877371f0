"""``moe_throughput.py --model mixtral``: a Hugging Face Mixtral-shaped MoE against a dense model
of the same active parameters, in plain PyTorch loops and through ``gt.initialize``.

* ``moe``: ``MixtralForCausalLM``, 8 experts, top 2, SwiGLU experts of width ``ffn``;
* ``dense``: ``MistralForCausalLM``, the same but one SwiGLU MLP of width ``top_k x ffn``
  (the active parameters differ by the router only).

Both in bf16 (weights, AdamW, activations), SDPA attention, random token ids, next-token
cross entropy; the router's auxiliary loss off (Mixtral's default). Loops:

* ``plain``: ``model(input_ids).logits``, ``F.cross_entropy``, ``backward``, fused AdamW:
  the MoE runs ``transformers``' own experts (``config._experts_implementation``, its
  ``grouped_mm`` where the device has it);
* ``engine``: ``gt.initialize(model, optimizer, gt.nn.CrossEntropyLoss())`` with
  ``moe.expert_parallel_size`` 1: the MoE's experts run gridtrain's grouped dispatch
  (grouped GEMMs, no host sync) on Hopper in bf16, the model's own forward elsewhere.

Eager unless ``--compile`` (``model.compile()`` for plain, the engine's CUDA default
for engine). Each loop warms up, then the loops take turns for ``--rounds`` rounds of
``--steps`` steps; each keeps its best round. ``vs dense`` divides by the dense model's
tokens/s in the same loop.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.nn.functional as F

import gridtrain as gt

EXPERTS, TOP_K = 8, 2


def sizes(args, device: str) -> dict:
    """Mixtral's proportions scaled down on a GPU (ffn = 3.5 x hidden, 4 query heads per
    key/value head); a tiny model on the CPU."""
    gpu = device == "cuda"
    return dict(
        hidden=args.hidden or (1024 if gpu else 64),
        depth=args.depth or (8 if gpu else 2),
        heads=16 if gpu else 4,
        kv_heads=4 if gpu else 2,
        ffn=(args.hidden or 1024) * 7 // 2 if gpu else 32,
        vocab=32000 if gpu else 128,
        seq=args.seq or (1024 if gpu else 32),
        batch=args.batch or (8 if gpu else 4),
        steps=args.steps or (10 if gpu else 2),
    )


def build(kind: str, s: dict, device: str) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["depth"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["seq"],
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    if kind == "moe":
        cfg = tf.MixtralConfig(
            intermediate_size=s["ffn"],
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            **common,
        )
    else:
        cfg = tf.MistralConfig(intermediate_size=TOP_K * s["ffn"], **common)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(dtype=dtype).train()


def active_params(model, kind: str) -> int:
    total = sum(p.numel() for p in model.parameters())
    if kind == "moe":  # only top_k of each layer's experts run per token
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        total -= experts - experts * TOP_K // EXPERTS
    return total


def adamw(model, device: str):
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")


class Plain:
    def __init__(self, model, device: str, compiled: bool):
        self.model, self.opt = model, adamw(model, device)
        if compiled:
            model.compile()

    def step(self, x, y) -> None:
        logits = self.model(input_ids=x).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Engine:
    def __init__(self, model, device: str, compiled: bool):
        self.engine, *_ = gt.initialize(model, adamw(model, device), gt.nn.CrossEntropyLoss())
        self.engine.train()

    def step(self, x, y) -> None:
        e = self.engine
        e.zero_grad()
        logits = e(input_ids=x).logits
        e.backward(e.criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        e.step()


def _timed(loop, batch, steps: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loop.step(*batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench(device: str, args) -> list[tuple]:
    s = sizes(args, device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g).to(device)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    config = dict(moe=dict(expert_parallel_size=1))
    if not args.compile:
        config["compile"] = False
    backend = "nccl" if device == "cuda" else "gloo"
    gt.launch(config, 0, 1, "127.0.0.1", _free_port(), backend=backend)
    try:
        runs = {}
        for kind in ("dense", "moe"):
            for name, cls in (("plain", Plain), ("engine", Engine)):
                model = build(kind, s, device)
                numbers = (sum(p.numel() for p in model.parameters()), active_params(model, kind))
                loop = cls(model, device, args.compile)
                _timed(loop, batch, 2, device)  # warm-up (and compilation)
                runs[(kind, name)] = (loop, numbers, [])
        for _ in range(args.rounds):
            for loop, _, times in runs.values():
                times.append(_timed(loop, batch, s["steps"], device))
    finally:
        gt.destroy()
    tokens = s["batch"] * s["seq"] * s["steps"]
    return [(device, k, n, *nums, tokens / min(t)) for (k, n), (_, nums, t) in runs.items()]


def run_mixtral(args) -> None:
    """Print the table (``args`` from ``moe_throughput.parse_args``)."""
    devices = ["cpu"] if args.device == "cpu" else []
    if args.device in ("all", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        elif args.device == "cuda":
            raise SystemExit("--device cuda: CUDA is not available")
    if args.device == "all" and not devices:
        devices = ["cpu"]
    rows = [row for d in devices for row in bench(d, args)]
    for d in devices:
        s = sizes(args, d)
        print(
            f"{d}: Mixtral-shaped, hidden {s['hidden']}, ffn {s['ffn']}, {s['depth']} layers, "
            f"{EXPERTS} experts top {TOP_K}, batch {s['batch']} x {s['seq']}, "
            f"{'bf16' if d == 'cuda' else 'fp32'}{', compiled' if args.compile else ''}; "
            f"best of {args.rounds} x {s['steps']} steps"
        )
    head = f"{'device':<7}{'model':<7}{'loop':<8}{'params':>14}{'active':>14}{'tokens/s':>12}"
    print(head + f"{'vs dense':>10}")
    dense = {(r[0], r[2]): r[5] for r in rows if r[1] == "dense"}
    for device, kind, loop, total, active, tps in rows:
        ratio = tps / dense[(device, loop)]
        print(f"{device:<7}{kind:<7}{loop:<8}{total:>14,}{active:>14,}{tps:>12,.0f}{ratio:>10.2f}")
