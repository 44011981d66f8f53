"""The presets in configs/ for real models validate and plan, in dry runs (no hub here)."""

import re
from pathlib import Path

import pytest
import yaml
from conftest import job_counts, run_snakemake

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_plans_every_stage_with_its_gpus(preset, tmp_path):
    config = yaml.safe_load(preset.read_text())
    out = run_snakemake(
        tmp_path, preset, "--dry-run", "--profile", str(ROOT / "profiles" / "slurm")
    ).stdout
    counts = job_counts(out)
    assert counts["extract"] == config["extract"]["shards"]
    assert counts["train"] == counts["evaluate"] == counts["verifier"] == 1
    train_block = out.split("rule train:", 1)[1].split("\n\n", 1)[0]
    assert f"gpu={config['train']['gpus']}" in train_block
    extract_blocks = re.findall(r"rule extract:.*?(?:\n\n|\Z)", out, flags=re.S)
    assert all(f"gpu={config['extract']['gpus_per_job']}" in b for b in extract_blocks)
