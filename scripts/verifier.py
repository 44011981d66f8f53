"""Materialise the verifier and write its identity record (verifier.json)."""

import argparse
import json
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.errors import cli
from eagle3lib.fileio import write_json
from eagle3lib.lifetime import hold_folders
from eagle3lib.verifier import materialize, portable


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", required=True, help="the config's verifier section as JSON")
    p.add_argument("--hf-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    a = p.parse_args()
    hold_folders("verifier", a.out, a.provenance, a.hf_dir)
    v = json.loads(a.verifier)
    record = materialize(
        v["path"],
        v.get("name"),
        a.hf_dir,
        trust_remote_code=v.get("trust_remote_code", False),
        allow_pickle=v.get("allow_pickle", False),
    )
    write_json(a.out, portable(record, a.out))
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(a.provenance, "verifier", v, a.out, None, stamp=a.stamp)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
