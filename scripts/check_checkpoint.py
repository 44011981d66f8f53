"""Check the checkpoint's format and reload it with speculators (reports/checkpoint.json)."""

import argparse
import json
import os
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.errors import cli
from eagle3lib.fileio import read_json, write_json
from eagle3lib.lifetime import hold_folders
from eagle3lib.verifier import read_record


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True, help="the checkpoint's config.json")
    p.add_argument("--manifest", type=Path, required=True, help="a shard manifest (layer ids)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    a = p.parse_args()
    hold_folders("check_checkpoint", a.out, a.provenance)

    from eagle3lib import checkpoint

    aux = read_json(a.manifest)["layer_ids"][:-1]
    report = checkpoint.check(a.config.parent, read_record(a.verifier), aux)
    report["checkpoint"] = os.path.relpath(a.config.parent, a.out.parent)  # as seen from it
    write_json(a.out, report)
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(
            a.provenance,
            "check_checkpoint",
            {"aux_layer_ids": aux},
            a.verifier,
            None,
            stamp=a.stamp,
        )
    print(json.dumps({k: v for k, v in report.items() if k != "tensors"}, indent=2))


if __name__ == "__main__":
    main()
