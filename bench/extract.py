"""Benchmark hidden-state extraction: this project's extract stage against the prefill roofline.

    python bench/extract.py --smoke                 # CPU, tiny model, seconds
    python bench/extract.py --tokens 600000         # one GPU, Llama-3.1-8B shape
    python bench/extract.py --jobs 2 --tokens ...   # K shard jobs at once on K leased GPUs
    python bench/extract.py --gpus-per-job 2 ...    # one job spread over 2 GPUs (device_map)

The verifier is a Llama-3.1-8B-architecture model with random bf16 weights (speed does not
depend on the values), built in GPU memory. Sample lengths are drawn from the token lengths of
the packaged ShareGPT conversations (bench/sharegpt_lengths.json, 100..2048). The timed path is
the real one: eagle3lib.hidden_states.extract_samples, shards written, hashed and fsynced. The
roofline is measured in the same run: the decoder's FLOPs per token (2 x the parameters without
the embedding and the LM head, which extraction never multiplies) over the measured bf16 matmul
rate; the older definition (2 x all parameters) is reported beside it. A plain forward over the
same batches, without hooks or writes, is timed twice: as extraction runs it (no attention mask:
right padding under causal attention) and with a padding mask (how it ran before).
It prints `key = value` lines, and writes the full result to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3lib import config, hidden_states, shards  # noqa: E402
from eagle3lib.config import ExtractConfig  # noqa: E402
from eagle3lib.fileio import sha256_file  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def build_model(shape: dict, gpus: int, dtype):
    """Random-weight Llama; with gpus > 1 its layers are spread over the GPUs (device_map)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"  # noqa: SLF001
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if gpus <= 1:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
            with torch.device(device):
                model = LlamaForCausalLM(config)
        else:  # a verifier bigger than one GPU: placed layer by layer over the GPUs
            from accelerate import dispatch_model, infer_auto_device_map

            with torch.device("meta"):
                model = LlamaForCausalLM(config)
            size = sum(p.numel() * p.element_size() for p in model.parameters())
            # A forced split: no GPU may hold more than its share (+10 %) of the weights.
            budget = {i: int(size / gpus * 1.1) for i in range(gpus)}
            device_map = infer_auto_device_map(
                model, max_memory=budget, no_split_module_classes=["LlamaDecoderLayer"]
            )
            # Host memory only (no slow host-side random init); weights are drawn on the GPUs.
            model.to_empty(device="cpu")
            rotary = type(model.model.rotary_emb)
            model.model.rotary_emb = rotary(config=config)  # its buffers are computed, not drawn
            model = dispatch_model(model, device_map=device_map)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.fill_(1.0)
                    else:
                        param.normal_(0.0, config.initializer_range)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def matmul_tflops(device: str, seconds: float = 3.0) -> float:
    """Sustained bf16 matmul rate (8192^3), timed with events after a warm-up."""
    if device == "cpu":
        n, dtype = 1024, torch.float32
    else:
        n, dtype = 8192, torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        sync(device)
        iters += 10
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def draw_lengths(total_tokens: int, seed: int, max_len: int) -> list[int]:
    pool = json.loads((ROOT / "bench" / "sharegpt_lengths.json").read_text())["lengths"]
    rng = np.random.default_rng(seed)
    lengths, n = [], 0
    while n < total_tokens:
        length = min(int(pool[rng.integers(len(pool))]), max_len)
        lengths.append(length)
        n += length
    return lengths


def one_job(args) -> dict:
    """Build the model, check exactness on a few samples, time extraction of one shard."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if args.smoke else LLAMA_8B
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(shape, args.gpus_per_job, dtype)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    decoder_params = (
        n_params
        - model.get_input_embeddings().weight.numel()
        - model.get_output_embeddings().weight.numel()
    )
    rate = matmul_tflops("cuda:0" if device == "cuda" else "cpu", 1.0 if args.smoke else 3.0)
    devices = sorted({str(p.device) for p in model.parameters()})
    roofline = rate * 1e12 / (2 * decoder_params)
    roofline_all = rate * 1e12 / (2 * n_params)

    layers = shape["num_hidden_layers"]
    aux = config.resolve_aux_layers(None, layers)
    lengths = draw_lengths(args.tokens, args.seed, args.max_len)
    rng = np.random.default_rng(args.seed + 1)
    samples = [rng.integers(0, shape["vocab_size"], n).astype(np.int64) for n in lengths]
    compile_setting = {"true": True, "false": False}[args.compile]
    cfg = ExtractConfig(
        batch_tokens=args.batch_tokens, storage=args.storage, compile=compile_setting
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shard = out / f"bench-shard-{os.getpid()}.safetensors"

    # Correctness before speed: the first samples equal a one-sample forward (bf16 tolerance).
    check = hidden_states.check_against_single_forward(model, aux, samples[:3])

    # Plain forward over all the same batches, no hooks and no writes: the compute-only rate,
    # without a mask (as extraction runs) and with a padding mask (as it ran before).
    dev = hidden_states.input_device(model)
    decoder = model.get_decoder()
    batches = hidden_states.length_batches(lengths, cfg.batch_tokens)

    def forward_only(masked: bool) -> float:
        with torch.inference_mode():
            sync(device)
            t = time.perf_counter()
            for b in batches:
                ids = np.zeros((len(b), lengths[b[0]]), dtype=np.int64)
                mask = np.zeros_like(ids)
                for r, i in enumerate(b):
                    ids[r, : lengths[i]] = samples[i]
                    mask[r, : lengths[i]] = 1
                decoder(
                    input_ids=torch.as_tensor(ids).to(dev),
                    attention_mask=torch.as_tensor(mask).to(dev) if masked else None,
                    use_cache=False,
                )
            sync(device)
            return sum(lengths) / (time.perf_counter() - t)

    with torch.inference_mode():
        for b in batches[:2]:  # warm-up
            decoder(
                input_ids=torch.as_tensor(np.stack([samples[i][: lengths[b[-1]]] for i in b])).to(
                    dev
                ),
                use_cache=False,
            )
    fwd_rate = fwd_masked_rate = None
    if not args.skip_forward:
        fwd_rate = forward_only(masked=False)
        fwd_masked_rate = forward_only(masked=True)

    t = time.perf_counter()
    stats = hidden_states.extract_samples(
        model,
        samples,
        [np.ones(n, np.uint8) for n in lengths],
        aux,
        cfg,
        shard,
        {"format": "bench"},
    )
    wall = time.perf_counter() - t
    size = shard.stat().st_size
    hash_ok = stats["sha256"] == sha256_file(shard) if args.verify_hash else None
    if not args.keep:
        shard.unlink()
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "gpus_per_job": args.gpus_per_job,
        "model_devices": devices,
        "params": n_params,
        "decoder_params": decoder_params,
        "model_build_seconds": round(build_s, 1),
        "matmul_tflops": round(rate, 1),
        "roofline_tokens_per_s": round(roofline),
        "roofline_all_params_tokens_per_s": round(roofline_all),
        "forward_only_tokens_per_s": fwd_rate and round(fwd_rate),
        "forward_only_masked_tokens_per_s": fwd_masked_rate and round(fwd_masked_rate),
        "tokens": int(sum(lengths)),
        "samples": len(lengths),
        "seconds": round(wall, 3),
        "tokens_per_s": round(sum(lengths) / wall),
        # extract.compile: the rate once compiled (a run's compiling weighs less the more tokens
        # it extracts; a job that compiles while another one extracts hides it)
        "tokens_per_s_after_compiling": round(sum(lengths) / (wall - stats["compile_seconds"]))
        if stats["compiled"]
        else None,
        "roofline_fraction": round(sum(lengths) / wall / roofline, 4),
        "roofline_all_params_fraction": round(sum(lengths) / wall / roofline_all, 4),
        "write_gb_per_s": round(size / wall / 1e9, 3),
        "shard_bytes": size,
        "bytes_per_token": round(size / sum(lengths), 2),
        "storage": args.storage,
        "bytes_per_token_bound": 1.01
        * shards.ShardLayout(
            (1,), len(aux) + 1, shape["hidden_size"], storage=args.storage
        ).bytes_per_token,
        "check_vs_single_forward": check,
        "padding_fraction": round(
            stats["padded_tokens"] / max(stats["padded_tokens"] + sum(lengths), 1), 4
        ),
        "writer_seconds": round(stats["write_seconds"], 2),
        "hash_seconds": round(stats["hash_seconds"], 2),
        "sha256_matches_file": hash_ok,
        "producer_stall_seconds": round(stats["stall_seconds"], 2),
        "compiled": stats["compiled"],
        "compile_seconds": stats["compile_seconds"],
        "start": t,
        "end": t + wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--storage", choices=("bf16", "fp8"), default="bf16", help="extract.storage")
    p.add_argument("--skip-forward", action="store_true", help="no forward-only passes")
    p.add_argument("--compile", choices=("true", "false"), default="false", help="extract.compile")
    p.add_argument("--jobs", type=int, default=1, help="shard jobs at once, one GPU lease each")
    p.add_argument("--gpus-per-job", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("BENCH_DIR", "/tmp/eagle3-bench"))
    p.add_argument("--keep", action="store_true", help="keep the shard files")
    p.add_argument(
        "--verify-hash", action="store_true", help="read the shard back: sha256 == the writer's"
    )
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument(
        "--baseline", default=None, help="a one-job --json result, for scaling efficiency"
    )
    args = p.parse_args()
    if args.tokens is None:
        args.tokens = 20000 if args.smoke else 600000

    if args.jobs > 1:  # the workstation path: K wrapped jobs, each leasing its own GPU(s)
        procs, files = [], []
        for j in range(args.jobs):
            files.append(Path(args.out) / f"job{j}.json")
            cmd = [
                sys.executable,
                str(ROOT / "scripts" / "gpu_job.py"),
                "--gpus",
                str(args.gpus_per_job),
                "--rule",
                f"bench-extract-{j}",
                "--record",
                str(Path(args.out) / f"gpu-{j}.json"),
                "--lock-dir",
                str(Path(args.out) / "locks"),
                "--",
                sys.executable,
                __file__,
                "--tokens",
                str(args.tokens // args.jobs),
                "--batch-tokens",
                str(args.batch_tokens),
                "--gpus-per-job",
                str(args.gpus_per_job),
                "--seed",
                str(args.seed + j),
                "--storage",
                args.storage,
                "--out",
                args.out,
                "--json",
                str(files[-1]),
                *(["--smoke"] if args.smoke else []),
            ]
            procs.append(subprocess.Popen(cmd))
        assert all(proc.wait() == 0 for proc in procs)
        jobs = [json.loads(f.read_text()) for f in files]
        span = max(j["end"] for j in jobs) - min(j["start"] for j in jobs)
        total = sum(j["tokens"] for j in jobs)
        result = {
            "jobs": args.jobs,
            "per_job": jobs,
            "tokens": total,
            "aggregate_tokens_per_s": round(total / span),
            "gpu_records": [
                json.loads((Path(args.out) / f"gpu-{j}.json").read_text()) for j in range(args.jobs)
            ],
        }
    else:
        result = one_job(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    tag = device_tag(args.jobs)
    if args.jobs > 1:
        print(f"extract.{tag}.aggregate_tokens_per_s = {result['aggregate_tokens_per_s']}")
        if args.baseline:
            single = json.loads(Path(args.baseline).read_text())["tokens_per_s"]
            eff = result["aggregate_tokens_per_s"] / (args.jobs * single)
            print(f"extract.{tag}.scaling_efficiency = {eff:.3f}")
    else:
        prefix = (
            f"extract.{tag}"
            + (f".gpus_per_job{args.gpus_per_job}" if args.gpus_per_job > 1 else "")
            + (".fp8" if args.storage == "fp8" else "")
        )
        print(f"{prefix}.tokens_per_s = {result['tokens_per_s']}")
        print(f"{prefix}.roofline_fraction = {result['roofline_fraction']}")
        print(f"{prefix}.roofline_all_params_fraction = {result['roofline_all_params_fraction']}")
        print(f"{prefix}.forward_only_tokens_per_s = {result['forward_only_tokens_per_s']}")
        print(
            f"{prefix}.forward_only_masked_tokens_per_s = "
            f"{result['forward_only_masked_tokens_per_s']}"
        )
        print(f"{prefix}.write_gb_per_s = {result['write_gb_per_s']}")
        print(f"{prefix}.bytes_per_token = {result['bytes_per_token']}")


def card_tag(names: list[str], count: int = 1) -> str:
    """The name benchmark keys give the cards a run used: h100 or h200 (from torch's device
    names; a lent "H200" may come as an H100), "gpu" for another card or a mix, with the count
    before it for several (2xh200)."""
    kinds = {m.group(0).lower() if (m := re.search(r"H[12]00", n)) else "gpu" for n in names}
    card = kinds.pop() if len(kinds) == 1 else "gpu"
    return card if count <= 1 else f"{count}x{card}"


def device_tag(count: int = 1) -> str:
    """The devices of a run of ``count`` processes, one a device, in benchmark keys: cpu, or the
    ``card_tag`` of this machine's first ``count`` GPUs, with the count before it for several
    (2xh200, 2xcpu)."""
    if not torch.cuda.is_available():
        return "cpu" if count <= 1 else f"{count}xcpu"
    names = [torch.cuda.get_device_name(i) for i in range(min(count, torch.cuda.device_count()))]
    return card_tag(names, count)


if __name__ == "__main__":
    main()
