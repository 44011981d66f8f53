"""Tokenize training conversations with the verifier's chat template (loss masks included)."""

import argparse
import json
import os
import re
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib import data
from eagle3lib.config import PrepareConfig, from_dict
from eagle3lib.conversations import read_eval_prompts, train_sources
from eagle3lib.errors import cli
from eagle3lib.fileio import write_json
from eagle3lib.leakage import EvalPromptIndex
from eagle3lib.lifetime import hold_folders
from eagle3lib.verifier import load_tokenizer, read_record


def job_threads() -> int:
    """The job's threads: snakemake sets OMP_NUM_THREADS to them (its leading number counts;
    1 without it), at most the CPUs this process may run on."""
    given = re.match(r"\s*(\d+)", os.environ.get("OMP_NUM_THREADS", ""))
    return max(1, min(int(given[1]) if given else 1, len(os.sched_getaffinity(0))))


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument(
        "--train",
        type=Path,
        nargs="+",
        required=True,
        help="conversations: data.train's file, then data.extra_train's (or the regenerated)",
    )
    p.add_argument(
        "--eval",
        type=Path,
        nargs="+",
        required=True,
        help="held-out prompt files to exclude, in the order of the config's eval sets",
    )
    p.add_argument("--data", required=True, help="the config's data section as JSON")
    p.add_argument("--out-samples", type=Path, required=True)
    p.add_argument("--out-info", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    p.add_argument(
        "--workers",
        type=int,
        default=job_threads(),
        help="tokenizing processes (default: OMP_NUM_THREADS, which snakemake sets to the "
        "job's threads, at most this process's CPUs; the samples are the same with any number)",
    )
    a = p.parse_args()
    hold_folders("prepare", a.out_samples, a.out_info, a.provenance)
    section = json.loads(a.data)
    cfg = from_dict(PrepareConfig, {**section, **section["train"]})
    record = read_record(a.verifier)
    tokenizer = load_tokenizer(record)
    held_out = EvalPromptIndex.build(
        [[x["text"] for x in read_eval_prompts(path, None)] for path in a.eval]
    )
    print(f"prepare: {a.workers} tokenizing processes", flush=True)
    sources = train_sources(a.train, section)
    prepared = data.prepare_samples(tokenizer, sources, cfg, held_out, a.workers)
    data.save_prepared(prepared, a.out_samples, record["vocab_size"])
    write_json(a.out_info, {**prepared.summary, "ids": prepared.ids})
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(a.provenance, "prepare", section, a.verifier, None, stamp=a.stamp)
    print(json.dumps(prepared.summary, indent=2))


if __name__ == "__main__":
    main()
