"""The SmolLM2-135M-Instruct quality run (configs/smollm2-gpu.yaml): smoke test and results table.

    python bench/quality_smollm2.py smoke --out DIR    # the preset's GPU settings on a tiny
                                                       # random verifier: every stage, minutes
    python bench/quality_smollm2.py table --out DIR    # BENCHMARKS rows from finished runs

The runs themselves are plain workflow runs (one per GPU when there are two):

    snakemake --configfile configs/smollm2-gpu.yaml --cores 16 --resources gpu=1
    snakemake --configfile configs/smollm2-gpu.yaml configs/overlays/no-regen.yaml \
        --cores 16 --resources gpu=1

``table`` reads results/<run>/reports/{summary,acceptance}.json of both and prints acceptance
per eval set and k, time and disk per stage, and ``quality.smollm2_preset.*`` key = value lines
(BENCHMARKS.md's keys for the shipped preset; ``quality.smollm2.*`` itself holds #19's current
two-seed build).

    python bench/quality_smollm2.py fp8-parity --parallel 2    # bf16 vs fp8 shards

``fp8-parity`` builds the preset without regeneration four times, bf16 and fp8 shards
(extract.storage) with train seeds 42 and 43, each under its own run name (``--parallel`` runs
at once, one GPU each), then prints acceptance per run, the mean per storage with the seeds'
spread, fp8 minus bf16 per eval set and k, and ``quality.smollm2.fp8.*`` lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"": "smollm2-gpu", "_no_regen": "smollm2-gpu-no-regen"}


def python_on_path(work: Path) -> dict[str, str]:
    """The environment with this interpreter as ``python`` (the rules call ``python``): its
    folder first (a venv's), else a link named python (an image with only python3)."""
    import os

    dirs = [str(Path(sys.executable).parent)]
    if not (Path(sys.executable).parent / "python").exists():
        bin_dir = work / "bin"
        bin_dir.mkdir(exist_ok=True)
        if not (bin_dir / "python").exists():
            (bin_dir / "python").symlink_to(sys.executable)
        dirs.insert(0, str(bin_dir))
    return {**os.environ, "PATH": os.pathsep.join([*dirs, os.environ.get("PATH", "")])}


def smoke(out: Path, gpus: int = 1) -> int:
    """The preset's GPU-specific settings (regeneration, GPU leases, replay over two sets and
    two k) on the tests' tiny verifier, through a real snakemake run."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny
    import yaml

    work = out / "smoke"
    work.mkdir(parents=True, exist_ok=True)
    verifier = tiny.build_verifier(work / "tiny-llama", hidden=128, heads=2, kv_heads=2)
    train = tiny.write_jsonl(work / "train.jsonl", tiny.conversations(64, seed=7))
    evals = tiny.write_jsonl(
        work / "eval.jsonl",
        [{"question_id": i, "turns": [f"Question {i} about models"]} for i in range(8)],
    )
    human = tiny.write_jsonl(
        work / "code.jsonl", [{"task_id": f"T/{i}", "prompt": f"def f{i}(x):\n"} for i in range(8)]
    )
    preset = yaml.safe_load((ROOT / "configs" / "smollm2-gpu.yaml").read_text())
    for section in preset.values():  # --cpu: the same settings without GPU leases
        if isinstance(section, dict):
            for key in ("gpus", "gpus_per_job"):
                if key in section:
                    section[key] = gpus
    config = tiny.write_config(
        work / "config.yaml",
        "smoke",
        verifier,
        train,
        evals,
        data={
            "train": {"path": str(train)},
            "eval": {"name": "mtbench", "path": str(evals)},
            "extra_eval": [{"name": "humaneval", "path": str(human)}],
            "max_length": 256,
        },
        regenerate={**preset["regenerate"], "max_new_tokens": 24, "chunk_size": 32},
        extract={**preset["extract"], "shards": 2},
        train={"epochs": 2, "total_seq_len": 512, "draft_vocab_size": 256, "gpus": gpus},
        evaluate={**preset["evaluate"], "max_new_tokens": 32},
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(ROOT / "Snakefile"),
            "--directory",
            str(work),
            "--configfile",
            str(config),
            "--cores",
            "8",
            "--resources",
            f"gpu={gpus}",
        ],
        capture_output=True,
        text=True,
        env=python_on_path(work),
    )
    (out / "smoke_snakemake.log").write_text(proc.stdout + proc.stderr)
    print(f"smoke: snakemake exit {proc.returncode} in {time.perf_counter() - t0:.0f} s")
    if proc.returncode:
        print((proc.stdout + proc.stderr)[-4000:])
        for log in sorted((work / "results" / "smoke" / "logs").glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-1500:]}")
        return proc.returncode
    acceptance = json.loads((work / "results/smoke/reports/acceptance.json").read_text())
    for r in acceptance["results"]:
        print(f"smoke: {r['eval_set']} k={r['k']} acceptance_length={r['acceptance_length']:.3f}")
    summary = json.loads((work / "results/smoke/reports/summary.json").read_text())
    print("smoke: seconds per job", json.dumps(summary["seconds_per_job"]))
    print("smoke: problems", summary["problems"])
    return 0


def smollm2_shaped_model():
    """A random model of SmolLM2-135M's shape in bf16 on the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from train import SMOLLM2  # bench/train.py: the shape its --shape smollm2 trains on

    cfg = LlamaConfig(**{**SMOLLM2, "tie_word_embeddings": True})  # as the real model
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def generate_speed(batches: tuple[int, ...], regenerate_only: bool) -> None:
    """HF batched generate of a random model of SmolLM2-135M's shape, left-padded prompts of
    mixed length as regeneration sends them: seconds per decode step with the dynamic KV cache
    (what regenerate used), a static cache, and a static cache with generate's auto-compile;
    then regenerate.compile as the regenerate job runs it (regenerate_compile_speed).
    ``regenerate_only``: only the latter."""
    import torch

    model = smollm2_shaped_model()
    if regenerate_only:
        regenerate_compile_speed(model, batches)
        return
    variants = {
        "dynamic": {},
        "static": {"cache_implementation": "static", "disable_compile": True},
        "static+compile": {"cache_implementation": "static"},
    }
    for batch, width, new in ((b, 512, 256) for b in batches):
        lengths = torch.randint(64, width + 1, (batch,))
        ids = torch.randint(100, 49000, (batch, width), device="cuda")
        mask = (torch.arange(width)[None] >= (width - lengths)[:, None]).long().cuda()
        for name, kwargs in variants.items():
            for attempt in ("first", "again") if "compile" in name else ("first",):
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.inference_mode():
                    model.generate(
                        ids,
                        attention_mask=mask,
                        max_new_tokens=new,
                        min_new_tokens=new,
                        do_sample=False,
                        pad_token_id=0,
                        **kwargs,
                    )
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
                print(
                    f"generate {name:<15} {attempt:<5} batch={batch} prompt<={width} new={new}: "
                    f"{dt:6.1f} s, {dt / new * 1000:6.1f} ms/step, "
                    f"{batch * new / dt:>9,.0f} tok/s, peak {torch.cuda.max_memory_allocated() / 2**30:.0f} GiB",
                    flush=True,
                )
                torch.cuda.reset_peak_memory_stats()
    regenerate_compile_speed(model, batches)


def regenerate_compile_speed(model, batches: tuple[int, ...]) -> None:
    """regenerate.compile as the regenerate job runs it (eagle3lib.regenerate.hf_generate):
    one shape per call, so the second call and a call of other prompts reuse the first's
    compiled decoding. Prompts of 64-512 random tokens, at most 256 new ones (a random model
    may end a reply early at token 0)."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(ROOT))
    from eagle3lib.config import RegenerateConfig
    from eagle3lib.regenerate import hf_generate

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    for batch in batches:
        for compiled in (False, True):
            cfg = RegenerateConfig(max_new_tokens=256, batch_size=batch, compile=compiled)
            generate = hf_generate(model, tokenizer, cfg, prompt_width=512)
            for attempt, rows in (("first", batch), ("again", batch), ("other prompts", batch - 7)):
                lengths = torch.randint(64, 513, (rows,)).tolist()
                prompts = [torch.randint(100, 49000, (n,)).tolist() for n in lengths]
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = generate(prompts)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
                print(
                    f"regenerate.compile={compiled} batch={batch} {attempt}: {dt:6.1f} s, "
                    f"{sum(map(len, out)) / dt:>9,.0f} new tokens/s",
                    flush=True,
                )


def table(results: Path, out: Path | None) -> str:
    lines, keys = [], []
    lines.append(
        "| run | eval set | k | acceptance length | per-position acceptance | prompts | steps |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    stages = []
    for suffix, run in RUNS.items():
        reports = results / run / "reports"
        if not (reports / "acceptance.json").exists():
            lines.append(f"| {run} | (not run) | | | | | |")
            continue
        acceptance = json.loads((reports / "acceptance.json").read_text())
        for r in acceptance["results"]:
            per_pos = ", ".join(f"{p:.3f}" for p in r["per_position_acceptance"])
            lines.append(
                f"| {run} | {r['eval_set']} | {r['k']} | {r['acceptance_length']:.3f} | {per_pos} "
                f"| {r['prompts']} | {r['steps']} |"
            )
            key = f"quality.smollm2_preset.{r['eval_set']}.k{r['k']}"
            keys.append(f"{key}.acceptance_length{suffix} = {r['acceptance_length']:.4f}")
            keys.append(f"{key}.per_position_acceptance{suffix} = {per_pos}")
        if "argmax_agreement" in acceptance:
            keys.append(
                f"quality.smollm2_preset.argmax_agreement{suffix} = {acceptance['argmax_agreement']:.5f}"
            )
        summary_path = reports / "summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            stages.append((run, summary))
    for run, summary in stages:
        lines += ["", f"`{run}`: seconds per job / MB on disk per stage", ""]
        lines.append("| job | seconds |")
        lines.append("|---|---|")
        lines += [f"| {j} | {s} |" for j, s in summary["seconds_per_job"].items()]
        lines.append("")
        lines.append("| stage | MB |")
        lines.append("|---|---|")
        lines += [f"| {s} | {b / 1e6:,.1f} |" for s, b in summary.get("disk_bytes", {}).items()]
        lines.append("")
        data, hs = summary["data"], summary["hidden_states"]
        lines.append(
            f"samples {data.get('samples')}, hidden-state tokens {hs['tokens']:,}, "
            f"regenerated {json.dumps(summary.get('regenerated'))}"
        )
    text = "\n".join(lines + [""] + keys) + "\n"
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality_smollm2.md").write_text(text)
    return text


PARITY = [(storage, seed) for storage in ("bf16", "fp8") for seed in (42, 43)]


def parity_run(storage: str, seed: int) -> str:
    return f"smollm2-parity-{storage}-s{seed}"


def fp8_parity(out: Path, parallel: int, epochs: int | None, cores: int) -> int:
    """The preset (original answers) with bf16 and fp8 shards, two seeds each."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    pending = []
    for storage, seed in PARITY:
        overlay = out / f"{parity_run(storage, seed)}.yaml"
        train = {"seed": seed, **({"epochs": epochs} if epochs else {})}
        overlay.write_text(
            yaml.safe_dump(
                {
                    "run": parity_run(storage, seed),
                    "regenerate": {"enabled": False},
                    "extract": {"storage": storage},
                    "train": train,
                    "serve_check": {"enabled": False},  # no vLLM on the lent GPU image
                }
            )
        )
        pending.append(
            [sys.executable, "-m", "snakemake", "--configfile", "configs/smollm2-gpu.yaml",
             str(overlay), "--cores", str(cores // parallel), "--resources", "gpu=1",
             "--rerun-incomplete", "--show-failed-logs"]
        )  # fmt: skip
    running, failed = [], 0
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < parallel:
            cmd = pending.pop(0)
            log = open(out / f"{Path(cmd[5]).stem}.log", "w")  # noqa: SIM115 - closed below
            running.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log,
                                             env=python_on_path(out)), log, cmd[5]))  # fmt: skip
        time.sleep(5)
        for item in list(running):
            proc, log, overlay = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                failed += proc.returncode != 0
                print(f"parity: {Path(overlay).stem} exit {proc.returncode} "
                      f"at {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    print(parity_table(ROOT / "results"))
    return 1 if failed else 0


def parity_table(results: Path) -> str:
    import statistics

    runs = {}
    for storage, seed in PARITY:
        path = results / parity_run(storage, seed) / "reports" / "acceptance.json"
        if path.exists():
            for r in json.loads(path.read_text())["results"]:
                runs[(storage, seed, r["eval_set"], r["k"])] = r
    lines = ["| storage | seed | eval set | k | acceptance length | per-position acceptance |"]
    lines.append("|---|---|---|---|---|---|")
    for (storage, seed, name, k), r in sorted(runs.items()):
        per = ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"])
        lines.append(
            f"| {storage} | {seed} | {name} | {k} | {r['acceptance_length']:.4f} | {per} |"
        )
    keys, deltas = [], []
    for name, k in sorted({(n, k) for (_, _, n, k) in runs}):
        means = {}
        for storage in ("bf16", "fp8"):
            values = [runs[(storage, s, name, k)]["acceptance_length"]
                      for s in (42, 43) if (storage, s, name, k) in runs]  # fmt: skip
            if len(values) == 2:
                means[storage] = statistics.mean(values)
                keys.append(f"quality.smollm2.{storage}.{name}.k{k}.acceptance_length = "
                            f"{means[storage]:.4f}")  # fmt: skip
                keys.append(f"quality.smollm2.{storage}.{name}.k{k}.seed_spread = "
                            f"{abs(values[0] - values[1]):.4f}")  # fmt: skip
        if len(means) == 2:
            delta = means["fp8"] - means["bf16"]
            keys.append(f"quality.smollm2.fp8.{name}.delta_k{k} = {delta:+.4f}")
            if k == 3:
                deltas.append(abs(delta))
    if deltas:
        keys.append(
            f"quality.smollm2.fp8.delta_k3 = {max(deltas):.4f}  (largest |fp8 - bf16| at k = 3)"
        )
    return "\n".join(lines + [""] + keys) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=["smoke", "generate-speed", "table", "fp8-parity"])
    p.add_argument("--parallel", type=int, default=1, help="fp8-parity: runs at once (GPUs)")
    p.add_argument("--epochs", type=int, default=None, help="fp8-parity: train.epochs")
    p.add_argument("--cores", type=int, default=16)
    p.add_argument("--out", type=Path)
    p.add_argument("--cpu", action="store_true", help="smoke without GPUs")
    p.add_argument("--results", type=Path, default=Path("results"))
    p.add_argument("--batches", default="2048,512", help="generate-speed: batch sizes")
    p.add_argument(
        "--regenerate-only", action="store_true", help="generate-speed: regenerate.compile only"
    )
    a = p.parse_args()
    if a.mode == "smoke":
        return smoke(a.out or Path("/tmp/quality-smoke"), 0 if a.cpu else 1)
    if a.mode == "fp8-parity":
        return fp8_parity(a.out or Path("/tmp/fp8-parity"), a.parallel, a.epochs, a.cores)
    if a.mode == "generate-speed":
        generate_speed(tuple(int(b) for b in a.batches.split(",")), a.regenerate_only)
        return 0
    print(table(a.results, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
