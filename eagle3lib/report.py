"""reports/summary.json (the documented result): the stages' records gathered, and the
problems that make a build invalid. summary.md and tables.html are in report_text, the plots
in report_plots."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from eagle3lib.fileio import read_json
from eagle3lib.gpu import job_leaks


def fmt(value: float | None, digits: int = 3) -> str:
    """A figure for people; 'n/a' when there was nothing to measure (no verifier step)."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def gpu_memory_entry(r: dict[str, Any]) -> dict[str, Any]:
    """One host's NVML readings before/after a job, or the honest reason there are none."""
    before, after = r["before"], r["after"]
    entry: dict[str, Any] = {
        "rule": r["rule"],
        "host": r.get("host"),
        "gpus_requested": r["gpus_requested"],
    }
    if not before.get("available"):
        entry.update(available=False, reason=before.get("reason"))
    elif not after.get("available"):
        # NVML answered before the job but not after it (a driver that lost the GPU): no
        # readings to compare, and the reason says when it was lost
        entry.update(available=False, reason=f"after the job: {after.get('reason')}")
    else:
        entry.update(
            available=True,
            devices=[
                {
                    "index": b["index"],
                    "name": b["name"],
                    "before_mib": b["used_mib"],
                    "after_mib": a["used_mib"],
                }
                for b, a in zip(before["devices"], after["devices"], strict=True)
            ],
        )
    entry["leaks"] = job_leaks(before, after, r.get("shared_by", 1))
    entry["stray_processes"] = r.get("stray_processes", False)
    return entry


def gpu_memory_table(records: dict[str, Path]) -> dict[str, Any]:
    """Per GPU job, and per node of a job over several nodes (``<job> node <i>``): the
    readings of the host that ran it. Device indices are per host, so each entry compares a
    host's devices only with themselves: jobs on different nodes never mix."""
    table = {}
    for job, path in sorted(records.items()):
        r = read_json(path)
        if "per_node" in r:
            for i, part in enumerate(r["per_node"]):
                table[f"{job} node {i}"] = gpu_memory_entry(part)
            if r.get("stray_processes"):  # the srun step's own leftovers
                table[f"{job} node 0"]["stray_processes"] = True
        else:
            table[job] = gpu_memory_entry(r)
    return table


def benchmark_seconds(paths: dict[str, Path]) -> dict[str, float]:
    """Wall seconds per job from Snakemake's benchmark: TSV files."""
    out = {}
    for job, path in sorted(paths.items()):
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            out[job] = round(float(rows[-1]["s"]), 2)
    return out


def vllm_summary(vllm: dict[str, Any] | None, offline: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's acceptance next to the offline evaluator's, and their relative difference."""
    if vllm is None:
        return None
    out = {
        k: vllm[k]
        for k in (
            "k",
            "prompts",
            "acceptance_length",
            "per_position_acceptance",
            "drafts",
            "text_matches_verifier",
            "mismatched_prompts",
            "serve_command",
            "vllm_version",
        )
    }
    if vllm["acceptance_length"] and offline["acceptance_length"]:
        out["offline_vs_vllm_relative_difference"] = (
            offline["acceptance_length"] / vllm["acceptance_length"] - 1
        )
    pairs = zip(offline["per_position_acceptance"], vllm["per_position_acceptance"], strict=False)
    out["offline_vs_vllm_max_position_difference"] = max(
        (abs(a - b) for a, b in pairs), default=None
    )
    return out


def provenance_table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per job: what made it (config hash, commit, packages, verifier, host, GPUs)."""
    return {
        r["job"]: {
            "config_sha256": r["config_sha256"],
            "git": r["git"],
            "packages": r["packages"],
            "verifier": r["verifier"],
            "seed": r["seed"],
            "host": r["host"],
            "gpus": r["gpus"],
        }
        for r in sorted(records, key=lambda r: r["job"])
    }


# The folders of results/<run>/ whose size the summary gives (disk_bytes): every job's folder
# in the job table (JOBS in rules/common.smk, Snakemake code that Python cannot import) and
# train/ (train's state and summary), in the order of the DAG; tests/test_rules.py checks the
# list against the table.
# (not reports/: the report would size it before writing its own files there)
STAGE_DIRS = (
    "verifier", "regenerated", "prepared", "hidden_states", "vocab", "train", "checkpoint",
)  # fmt: skip


def disk_usage(run: str, root: Path = Path("results")) -> dict[str, int]:
    """Bytes on disk per stage directory of results/<run>/."""
    usage = {}
    for stage in STAGE_DIRS:
        folder = root / run / stage
        if folder.exists():
            usage[stage] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return usage


def gpu_problems(gpu_memory: dict[str, Any]) -> list[str]:
    """GPU jobs that left device memory or processes behind, one line each naming the job."""
    problems = []
    for job, entry in gpu_memory.items():
        where = f"{job} on {entry['host']}" if entry.get("host") else job
        problems += [f"{where}: {leak}" for leak in entry["leaks"]]
        if entry["stray_processes"]:
            problems.append(f"{where}: left processes running after it finished")
    return problems


# replay scores the draft against batched greedy tokens: below this agreement with the
# teacher-forced argmax they are not the verifier's greedy decoding (bf16 ties stay far above)
ARGMAX_AGREEMENT_MIN = 0.99


# serve_check against the offline evaluator, the same prompts and k (the headline set's first
# k) and the same greedy text: on CPU they agree within a third of the tolerances below
# (tests/test_vllm.py; the demo gave 1.274 in both). A draft served otherwise than it was
# evaluated moves them far more: other aux layers take the acceptance length towards 1, a
# smaller served k zeroes the later positions, a larger one adds accepted tokens. Near-tied
# greedy tokens that bf16 kernels decide differently could move them a little on GPUs (not
# measured here).
VLLM_MAX_RELATIVE_DIFFERENCE = 0.03  # of the acceptance length (offline / vLLM - 1)
VLLM_MAX_POSITION_DIFFERENCE = 0.05  # of any position's acceptance rate, absolute


def vllm_problems(vllm: dict[str, Any] | None, offline: dict[str, Any]) -> list[str]:
    """Where vLLM's acceptance (the summary's vllm block) disagrees with the offline
    evaluator's headline result (``offline``) beyond the tolerances above, one line each."""
    if vllm is None:
        return []
    problems = []
    if not vllm["text_matches_verifier"]:
        problems.append(
            f"serve_check: vLLM with the draft decoded {len(vllm['mismatched_prompts'])} prompt(s) "
            "differently from vLLM without it"
        )
    if (vllm["k"], vllm["prompts"]) != (offline["k"], offline["prompts"]):
        return problems + [
            f"serve_check: vLLM measured k={vllm['k']} on {vllm['prompts']} prompts, the offline "
            f"evaluator's headline k={offline['k']} on {offline['prompts']}; rerun both "
            "(-R evaluate serve_check) so that they compare"
        ]
    if offline["acceptance_length"] is None:
        return problems  # reported as an acceptance problem
    where = f"serve_check (k={vllm['k']}, {vllm['prompts']} prompts)"
    remedy = "vLLM does not serve the draft as it was evaluated (k, aux layers, vocab map, dtype)"
    if vllm["acceptance_length"] is None:
        return problems + [f"{where}: vLLM counted no draft step; {remedy}"]
    difference = vllm["offline_vs_vllm_relative_difference"]
    if abs(difference) > VLLM_MAX_RELATIVE_DIFFERENCE:
        problems.append(
            f"{where}: acceptance length offline {fmt(offline['acceptance_length'], 4)} vs vLLM "
            f"{fmt(vllm['acceptance_length'], 4)} differs by {difference:+.1%}, more than the "
            f"{VLLM_MAX_RELATIVE_DIFFERENCE:.0%} allowed; {remedy}"
        )
    gaps = [
        abs(a - b)
        for a, b in zip(
            offline["per_position_acceptance"], vllm["per_position_acceptance"], strict=True
        )
    ]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    if gaps[worst] > VLLM_MAX_POSITION_DIFFERENCE:
        problems.append(
            f"{where}: per-position acceptance offline "
            f"{', '.join(f'{p:.3f}' for p in offline['per_position_acceptance'])} vs vLLM "
            f"{', '.join(f'{p:.3f}' for p in vllm['per_position_acceptance'])} differs by "
            f"{gaps[worst]:.3f} at position {worst + 1}, more than the "
            f"{VLLM_MAX_POSITION_DIFFERENCE} allowed; {remedy}"
        )
    return problems


def gate_problems(gate: dict[str, dict[str, float]], acceptance: dict[str, Any]) -> list[str]:
    """Results below validate.min_acceptance_length ({eval set: {k: least length}})."""
    results = {(r["eval_set"], r["k"]): r for r in acceptance.get("results", [])}
    problems = []
    for name, per_k in gate.items():
        for k, minimum in per_k.items():
            r = results.get((name, int(k)))
            if r is None:
                problems.append(
                    f"acceptance ({name} k={k}): not measured, but validate.min_acceptance_length "
                    "requires it; rerun evaluate (-R evaluate)"
                )
            elif r["acceptance_length"] is None or r["acceptance_length"] < minimum:
                problems.append(
                    f"acceptance ({name} k={k}): acceptance length "
                    f"{fmt(r['acceptance_length'], 4)} is below "
                    f"validate.min_acceptance_length {minimum}"
                )
    return problems


def text_matches_verifier(acceptance: dict[str, Any]) -> bool | None:
    """Whether every eval set at every k decoded as verifier-only greedy decoding does: False
    if one did not, None where none was checked (replay: greedy by construction)."""
    found = [r.get("text_matches_verifier") for r in acceptance.get("results") or [acceptance]]
    if False in found:
        return False
    return None if all(f is None for f in found) else True


def problems_of(summary: dict[str, Any]) -> list[str]:
    """Everything that makes the build invalid, one line each."""
    problems = [f"checkpoint: {p}" for p in summary["checkpoint"]["problems"]]
    valid = summary["checkpoint"].get("valid", True) and summary.get("checkpoint_valid", True)
    if not valid and not problems:
        problems.append("checkpoint: not valid, though no problem is recorded with it")
    problems += gpu_problems(summary["gpu_memory"])
    problems += vllm_problems(summary.get("vllm"), summary["acceptance"])
    problems += gate_problems(summary.get("min_acceptance_length") or {}, summary["acceptance"])
    if summary["acceptance_length"] is None:
        problems.append("acceptance: no verifier step was measured (raise evaluate.max_new_tokens)")
    for i, r in enumerate(summary["acceptance"].get("results") or [summary["acceptance"]]):
        where = f"{r['eval_set']} k={r['k']}" if "eval_set" in r else f"k={r['k']}"
        length = r.get("acceptance_length")
        if length is None and i > 0:  # (the first result is the headline, named above)
            problems.append(
                f"acceptance ({where}): no verifier step was measured (raise "
                "evaluate.max_new_tokens, or give the set prompts that leave room to decode)"
            )
        if length is not None and not 1 <= length <= 1 + r["k"]:
            problems.append(
                f"acceptance ({where}): acceptance length {fmt(length, 4)} is outside [1, "
                f"{1 + r['k']}], which no decoding gives: acceptance.json was damaged or "
                "edited; rerun evaluate (-R evaluate)"
            )
        if r.get("text_matches_verifier") is False:  # None: replay, greedy by construction
            problems.append(
                f"acceptance ({where}): {r['mismatched_prompts']} prompt(s) decoded "
                "differently from verifier-only greedy decoding"
            )
        agreement = r.get("argmax_agreement")
        if agreement is not None and agreement < ARGMAX_AGREEMENT_MIN:
            problems.append(
                f"acceptance ({where}): the greedy tokens equal the verifier's argmax at only "
                f"{agreement:.1%} of positions; a generation setting changes greedy decoding"
            )
    return problems


def data_summary(prepare: dict[str, Any], acceptance: dict[str, Any]) -> dict[str, Any]:
    """prepare's summary, with the conversations dropped for overlap with an eval set keyed by
    the set's name (prepare counts them per eval file, in the order evaluate runs the sets)."""
    if "eval_overlap" not in prepare:
        return prepare
    overlap = dict(prepare["eval_overlap"])
    counts = overlap.pop("dropped_per_eval_file")
    names = list(dict.fromkeys(r["eval_set"] for r in acceptance["results"]))
    if len(names) != len(counts):
        raise ValueError(
            f"prepare counted overlaps with {len(counts)} eval file(s), evaluate ran "
            f"{len(names)} eval set(s)"
        )
    overlap["dropped_per_eval_set"] = dict(zip(names, counts, strict=True))
    return {**prepare, "eval_overlap": overlap}


def hidden_states_summary(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' totals from their manifests (the layers and dtype are the first shard's)."""
    return {
        "shards": len(manifests),
        "tokens": sum(m["tokens"] for m in manifests),
        "bytes": sum(m["file"]["bytes"] for m in manifests),
        "layer_ids": manifests[0]["layer_ids"],
        "state_dtype": manifests[0].get("state_dtype", "bfloat16"),
        "rejected_samples": sum(len(m["rejected"]) for m in manifests),
    }


def summarize(
    run: str,
    verifier: dict[str, Any],
    prepare: dict[str, Any],
    manifests: list[dict[str, Any]],
    vocab: dict[str, Any],
    training: dict[str, Any],
    checkpoint: dict[str, Any],
    acceptance: dict[str, Any],
    gpu_records: dict[str, Path],
    benchmarks: dict[str, Path],
    provenance: list[dict[str, Any]] = (),
    vllm: dict[str, Any] | None = None,
    regenerated: dict[str, Any] | None = None,
    min_acceptance_length: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    gpu = gpu_memory_table(gpu_records)
    summary = {
        "run": run,
        "verifier": {
            k: verifier[k]
            for k in ("name", "path", "num_hidden_layers", "hidden_size", "vocab_size")
        }
        | {k: verifier.get(k, False) for k in ("trust_remote_code", "custom_code")},
        "k": acceptance["k"],
        "acceptance_length": acceptance["acceptance_length"],
        "per_position_acceptance": acceptance["per_position_acceptance"],
        "text_matches_verifier": text_matches_verifier(acceptance),
        "checkpoint_valid": checkpoint["valid"],
        "gpu_memory": gpu,
        "acceptance": {k: v for k, v in acceptance.items() if k != "per_prompt"},
        "checkpoint": {
            k: checkpoint[k]
            for k in ("valid", "problems", "verifier", "aux_layer_ids", "draft_vocab_size")
            if k in checkpoint
        },
        "data": data_summary(prepare, acceptance),
        "hidden_states": hidden_states_summary(manifests),
        "vocab": vocab,
        "training": training,
        "seconds_per_job": benchmark_seconds(benchmarks),
        "disk_bytes": disk_usage(run),
        "provenance": provenance_table(provenance),
        "vllm": vllm_summary(vllm, acceptance),
        "regenerated": regenerated,
        "min_acceptance_length": min_acceptance_length or {},
    }
    summary["problems"] = problems_of(summary)
    summary["valid"] = not summary["problems"]
    return summary
