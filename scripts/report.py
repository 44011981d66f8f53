"""Write reports/summary.json, summary.md and the plots from every stage's outputs."""

import argparse
import json
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib import report, report_plots, report_text
from eagle3lib.errors import cli
from eagle3lib.fileio import atomic_path, read_json, write_json
from eagle3lib.lifetime import hold_folders


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--samples-info", type=Path, required=True)
    p.add_argument("--manifests", type=Path, nargs="+", required=True)
    p.add_argument("--vocab-info", type=Path, required=True)
    p.add_argument("--train-summary", type=Path, required=True)
    p.add_argument("--checkpoint-report", type=Path, required=True)
    p.add_argument("--acceptance", type=Path, required=True)
    p.add_argument("--gpu", type=Path, nargs="+", required=True, help="gpu/<job>.json records")
    p.add_argument("--benchmarks", type=Path, nargs="*", default=[], help="benchmarks/<job>.tsv")
    p.add_argument("--provenance", type=Path, nargs="*", default=[], help="provenance-<job>.json")
    p.add_argument("--vllm-acceptance", type=Path, nargs="*", default=[], help="serve_check result")
    p.add_argument("--regenerated", type=Path, nargs="*", default=[], help="regenerate.json")
    p.add_argument(
        "--min-acceptance-length",
        default="{}",
        help="validate.min_acceptance_length as JSON ({eval set: {k: least length}})",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--out-markdown", type=Path, required=True)
    p.add_argument("--out-plot-acceptance", type=Path, required=True)
    p.add_argument("--out-plot-loss", type=Path, required=True)
    p.add_argument("--out-tables", type=Path, required=True, help="HTML tables for --report")
    p.add_argument("--out-provenance", type=Path, help="write provenance-report.json here")
    p.add_argument("--stamp", help="what made the report (JSON, from the rule)")
    return p.parse_args()


@cli
def main() -> None:
    a = arguments()
    outputs = (a.out, a.out_markdown, a.out_plot_acceptance, a.out_plot_loss, a.out_tables)
    hold_folders("report", *outputs, a.out_provenance)

    prepare = read_json(a.samples_info)
    prepare.pop("ids", None)
    training = read_json(a.train_summary)
    curves = training.pop("curves")
    summary = report.summarize(
        run=a.run,
        verifier=read_json(a.verifier),
        prepare=prepare,
        manifests=[read_json(m) for m in a.manifests],
        vocab=read_json(a.vocab_info),
        training={
            **training,
            "final_train_loss": (curves["train_loss"] or [None])[-1],
            "val": curves["val"],
        },
        checkpoint=read_json(a.checkpoint_report),
        acceptance=read_json(a.acceptance),
        gpu_records={g.stem: g for g in a.gpu},
        benchmarks={b.stem: b for b in a.benchmarks if b.exists()},
        provenance=[read_json(p) for p in a.provenance],
        vllm=read_json(a.vllm_acceptance[0]) if a.vllm_acceptance else None,
        regenerated=read_json(a.regenerated[0]) if a.regenerated else None,
        min_acceptance_length=json.loads(a.min_acceptance_length),
    )
    with atomic_path(a.out_plot_acceptance) as tmp:
        report_plots.plot_acceptance(
            summary["per_position_acceptance"],
            summary["k"],
            tmp,
            summary["acceptance"].get("by_category"),
            summary["acceptance"].get("eval_set"),
        )
    with atomic_path(a.out_plot_loss) as tmp:
        report_plots.plot_loss(curves, tmp)
    per_category = " and per category" if summary["acceptance"].get("by_category") else ""
    plots = {
        f"Acceptance per position{per_category}": a.out_plot_acceptance.name,
        "Training loss": a.out_plot_loss.name,
    }
    with atomic_path(a.out_markdown) as tmp:
        tmp.write_text(report_text.markdown(summary, plots), encoding="utf-8")
    with atomic_path(a.out_tables) as tmp:
        tmp.write_text(report_text.html_tables(summary), encoding="utf-8")
    write_json(a.out, summary)
    if a.out_provenance:
        from eagle3lib import provenance

        provenance.write(a.out_provenance, "report", {"run": a.run}, a.verifier, stamp=a.stamp)
    print(
        json.dumps(
            {k: summary[k] for k in ("acceptance_length", "per_position_acceptance", "valid")},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
