"""Where extraction's forward loses speed on the ShareGPT length mix, and what a job pays first.

    python bench/forward_speed.py --smoke          # CPU, tiny model: checks this script
    python bench/forward_speed.py --tokens 300000  # one GPU, Llama-3.1-8B shape (random bf16)

Forward variants over the same length-sorted batches as extraction (``length_batches``, hooks
capturing the aux layers and the last layer, states stacked as the writer gets them; no
writes), each timed twice in interleaved rounds:

- ``eager``: the HF modules as extraction runs them today;
- ``norm``: each RMSNorm's forward compiled (torch.compile, dynamic shapes);
- ``mlp``: each MLP's forward compiled (its three GEMMs stay cuBLAS; SiLU * up is fused);
- ``norm+mlp``: both;
- ``layer``: each decoder layer's forward compiled (norms, rotary, residuals fused);
- ``fused_gate_up+norm``: gate and up projections as one GEMM (weights concatenated), eager,
  with compiled norms.

Every variant's captured states on 8 samples are compared with eager's (max abs, rel L2), and
eager's with a one-sample forward (the exactness check extraction is held to). With ``--probe``
the verifier is also written as safetensors and fresh processes time what a job pays before
its first batch: interpreter and torch import, transformers' model classes, CUDA start, and
``from_pretrained`` onto the GPU (bench/workflow_gpu.py's probe). Prints a table and ``key = value`` lines; --json has it all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import extract as bench_extract  # noqa: E402

from eagle3lib.config import resolve_aux_layers  # noqa: E402
from eagle3lib.hidden_states import Capture, forward_states, length_batches  # noqa: E402
from eagle3lib.verifier import allow_recompiles, decoder_layers, text_decoder  # noqa: E402

VARIANTS = ("eager", "norm", "mlp", "norm+mlp", "layer", "fused_gate_up+norm")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class FusedGateUp(torch.nn.Module):
    """An MLP whose gate and up projections run as one GEMM (weights concatenated)."""

    def __init__(self, mlp):
        super().__init__()
        w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
        self.gate_up = torch.nn.Parameter(w, requires_grad=False)
        self.down = mlp.down_proj
        self.act = mlp.act_fn

    def forward(self, x):
        gate, up = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def apply(model, variant: str):
    """Patch ``model`` for ``variant``; returns a function that undoes it."""
    layers = decoder_layers(model)
    undo = []

    def compile_forward(module):
        original = module.forward
        module.forward = torch.compile(original, dynamic=True)
        undo.append(lambda: setattr(module, "forward", original))

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    if variant in ("norm", "norm+mlp", "fused_gate_up+norm"):
        for m in norms:
            compile_forward(m)
    if variant in ("mlp", "norm+mlp"):
        for layer in layers:
            compile_forward(layer.mlp)
    if variant == "layer":
        for layer in layers:
            compile_forward(layer)
    if variant == "fused_gate_up+norm":
        for layer in layers:
            original = layer.mlp
            layer.mlp = FusedGateUp(original)
            undo.append(lambda layer=layer, original=original: setattr(layer, "mlp", original))

    def restore():
        for u in reversed(undo):
            u()

    return restore


def run_pass(decoder, capture, samples, batches, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        forward_states(decoder, capture, [samples[i] for i in batch], device)
    sync(device)
    return time.perf_counter() - t0


def states_of(decoder, capture, samples, device) -> list[torch.Tensor]:
    return [s.float().cpu() for s in forward_states(decoder, capture, samples, device)]


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    worst, err, norm = 0.0, 0.0, 0.0
    for x, y in zip(a, b, strict=True):
        d = x.double() - y.double()
        worst = max(worst, float(d.abs().max()))
        err += float((d**2).sum())
        norm += float((y.double() ** 2).sum())
    return {"max_abs": worst, "rel_l2": (err / max(norm, 1e-30)) ** 0.5}


def probe(model, folder: Path) -> dict:
    """Fresh processes: what a job pays before its first batch (the weights in page cache);
    the workflow benchmark's probe (bench/workflow_gpu.py probe_load)."""
    from workflow_gpu import probe_load

    t0 = time.perf_counter()
    model.save_pretrained(folder)
    return {"save_seconds": time.perf_counter() - t0, "runs": probe_load(folder)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokens", type=int, default=300000)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe", type=Path, default=None, help="write the verifier here, time loads")
    p.add_argument("--fp32-reference", action="store_true", help="compare with an fp32 forward")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    allow_recompiles(256)  # one graph per layer object
    shape = bench_extract.TINY if a.smoke else bench_extract.LLAMA_8B
    if a.smoke:
        a.tokens, a.batch_tokens = min(a.tokens, 6000), 2048
    model = bench_extract.build_model(shape, 1, torch.float32 if a.smoke else torch.bfloat16)
    device = model.get_input_embeddings().weight.device
    result: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        result["matmul_tflops"] = bench_extract.matmul_tflops("cuda")
    lengths = bench_extract.draw_lengths(a.tokens, 0, 256 if a.smoke else 2048)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, shape["vocab_size"], (n,), generator=gen).numpy() for n in lengths]
    batches = length_batches(lengths, a.batch_tokens)
    tokens = sum(lengths)
    padded = sum(len(b) * lengths[b[0]] for b in batches) - tokens
    result.update(tokens=tokens, batches=len(batches), padded_fraction=padded / tokens)
    aux = resolve_aux_layers(None, shape["num_hidden_layers"])
    decoder = text_decoder(model)
    capture = Capture(decoder_layers(model), aux)
    check = [samples[i] for i in sorted(range(len(samples)), key=lambda i: lengths[i])[::97][:8]]
    reference = states_of(decoder, capture, check, device)
    single = [states_of(decoder, capture, [s], device)[0] for s in check]
    result["eager_batched_vs_single"] = compare(reference, single)
    variants = a.variants.split(",")
    rows = {v: {"seconds": []} for v in variants}
    states: dict[str, list[torch.Tensor]] = {}
    for r in range(a.rounds):
        for v in variants:
            restore = apply(model, v)
            try:
                if r == 0:  # compile (dynamic shapes) on three batch shapes, then check
                    t0 = time.perf_counter()
                    for batch in (batches[0], batches[len(batches) // 2], batches[-1]):
                        forward_states(decoder, capture, [samples[i] for i in batch], device)
                    sync(device)
                    rows[v]["warmup_seconds"] = time.perf_counter() - t0
                    states[v] = states_of(decoder, capture, check, device)
                    rows[v]["vs_eager"] = compare(states[v], reference)
                seconds = run_pass(decoder, capture, samples, batches, device)
            finally:
                restore()
            rows[v]["seconds"].append(seconds)
            print(f"round {r} {v}: {tokens / seconds:,.0f} tokens/s", flush=True)
    for row in rows.values():
        row["tokens_per_s"] = [tokens / s for s in row["seconds"]]
        row["best_tokens_per_s"] = max(row["tokens_per_s"])
    base = rows.get("eager", {}).get("best_tokens_per_s")
    result["variants"] = rows
    if a.fp32_reference:  # which variant is nearer the fp32 forward (done last: in place)
        model.float()
        truth = states_of(decoder, capture, check, device)
        result["vs_fp32"] = {v: compare(states[v], truth) for v in states}
        print(f"against the fp32 forward: {json.dumps(result['vs_fp32'])}", flush=True)
    capture.remove()
    if a.probe and device.type == "cuda":
        result["probe"] = probe(model, a.probe)
    print(
        f"\n{tokens:,} tokens, {len(batches)} batches of <= {a.batch_tokens}, padded "
        f"{100 * padded / tokens:.1f} %; eager batched vs one-sample: "
        f"{result['eager_batched_vs_single']}"
    )
    print(
        "| variant | tokens/s per round | vs eager | warm-up s | vs eager states max abs / rel L2 |"
    )
    print("|---|---|---|---|---|")
    for v, row in rows.items():
        ratio = row["best_tokens_per_s"] / base if base else float("nan")
        rates = ", ".join(f"{t:,.0f}" for t in row["tokens_per_s"])
        vs = row.get("vs_eager", {})
        print(
            f"| {v} | {rates} | {ratio:.3f} | {row.get('warmup_seconds', 0):.1f} | "
            f"{vs.get('max_abs', 0):.3g} / {vs.get('rel_l2', 0):.3g} |"
        )
    tag = bench_extract.device_tag()
    for v, row in rows.items():
        key = v.replace("+", "_")
        print(f"forward.{tag}.{key}.tokens_per_s = {row['best_tokens_per_s']:.0f}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
