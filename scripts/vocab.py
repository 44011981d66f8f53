"""Build the draft vocabulary map (d2t/t2d) from supervised token frequencies."""

import argparse
import json
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib import vocab
from eagle3lib.data import load_samples
from eagle3lib.errors import cli
from eagle3lib.fileio import write_json
from eagle3lib.lifetime import hold_folders


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--samples", type=Path, required=True)
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--out-map", type=Path, required=True)
    p.add_argument("--out-info", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    a = p.parse_args()
    hold_folders("vocab", a.out_map, a.out_info, a.provenance)
    freq = load_samples(a.samples).token_freq
    d2t, t2d = vocab.build(freq, a.draft_vocab_size)
    vocab.save(a.out_map, d2t, t2d)
    info = vocab.coverage(freq, t2d)
    write_json(a.out_info, info)
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(
            a.provenance,
            "vocab",
            {"draft_vocab_size": a.draft_vocab_size},
            None,
            None,
            stamp=a.stamp,
        )
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
