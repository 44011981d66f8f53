"""Fail (naming each problem) unless reports/summary.json says the build is valid."""

import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.errors import UserError, cli, first_line
from eagle3lib.fileio import atomic_path, read_json
from eagle3lib.lifetime import hold_folders
from eagle3lib.report import fmt, problems_of


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--summary", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    hold_folders("validate", a.out)
    summary = read_json(a.summary)
    try:  # judged again from the summary's figures, not only from its list
        problems = list(dict.fromkeys([*summary["problems"], *problems_of(summary)]))
    except (KeyError, TypeError) as exc:
        raise UserError(
            f"{a.summary}: not a summary the report job writes (no {first_line(exc)}); delete "
            "it and rerun, snakemake makes it again"
        ) from None
    if problems:
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        raise UserError(f"{a.summary}: {len(problems)} problem(s): {problems[0]}")
    line = (
        f"valid: acceptance_length={fmt(summary['acceptance_length'], 4)} k={summary['k']} "
        f"checkpoint_valid={summary['checkpoint_valid']}"
    )
    with atomic_path(a.out) as tmp:
        tmp.write_text(f"{line}\n", encoding="utf-8")
    print(line)  # the job's log says it too


if __name__ == "__main__":
    main()
