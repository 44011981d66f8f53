"""Extract one shard of verifier hidden states (aux layers + final pre-norm layer)."""

import argparse
import json
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.config import ExtractConfig, from_json
from eagle3lib.data import load_samples
from eagle3lib.errors import cli
from eagle3lib.fileio import read_json
from eagle3lib.lifetime import hold_folders
from eagle3lib.verifier import read_record


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--samples", type=Path, required=True)
    p.add_argument("--info", type=Path, required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--extract", required=True, help="the config's extract section as JSON")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--vllm", default="{}", help="the config's vllm section (vllm backend)")
    p.add_argument("--vllm-python", default=None, help="interpreter of the vLLM environment")
    p.add_argument("--out-shard", type=Path, required=True)
    p.add_argument("--out-manifest", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    a = p.parse_args()
    hold_folders(f"extract-{a.shard}", a.out_shard, a.out_manifest, a.provenance)

    import torch

    from eagle3lib.hidden_states import extract_shard

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = from_json(ExtractConfig, a.extract)
    ids = read_json(a.info)["ids"]
    stats = extract_shard(
        load_samples(a.samples),
        ids,
        a.shard,
        cfg,
        read_record(a.verifier),
        a.out_shard,
        a.out_manifest,
        engine=json.loads(a.vllm),
        vllm_python=a.vllm_python,
    )
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(
            a.provenance,
            f"extract-{a.shard}",
            json.loads(a.extract),
            a.verifier,
            None,
            stamp=a.stamp,
        )
    if stats["rejected"]:
        print(
            f"warning: {stats['rejected']} sample(s) rejected for non-finite states",
            file=sys.stderr,
        )
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
