rule report:
    """reports/summary.json (documented in the README), summary.md and plots."""
    input:
        unpack(report_inputs),
    output:
        summary=SUMMARY,
        markdown=SUMMARY_MD,
        plot_acceptance=report(
            PLOT_ACCEPTANCE, caption="report/acceptance.rst", category="Evaluation"
        ),
        plot_loss=report(PLOT_LOSS, caption="report/loss.rst", category="Training"),
        tables=report(REPORT_TABLES, caption="report/tables.rst", category="Summary"),
        provenance=PROVENANCE["report"],
    log:
        log("report"),
    conda:
        "../envs/train.yaml"
    params:
        run=RUN,
        stamp=stamp("report"),
        min_acceptance_length=acceptance_gate_json(),
    shell:
        CPU_ONLY
        + "python {input.script} --run {params.run} --verifier {input.verifier}"
        " --samples-info {input.samples_info} --manifests {input.manifests}"
        " --vocab-info {input.vocab_info} --train-summary {input.train_summary}"
        " --checkpoint-report {input.checkpoint_report} --acceptance {input.acceptance}"
        " --gpu {input.gpu} --benchmarks {input.benchmarks} --provenance {input.provenance}"
        " --vllm-acceptance {input.vllm_acceptance} --regenerated {input.regenerated}"
        " --min-acceptance-length {params.min_acceptance_length:q}"
        " --out {output.summary} --out-markdown {output.markdown}"
        " --out-plot-acceptance {output.plot_acceptance} --out-plot-loss {output.plot_loss}"
        " --out-tables {output.tables} --out-provenance {output.provenance}"
        " --stamp {params.stamp:q}"
        " > {log} 2>&1"


rule validate:
    """Fail the build, naming each problem, if the summary is not valid."""
    input:
        summary=SUMMARY,
        script=script("validate.py"),
    output:
        VALIDATION,
    log:
        log("validate"),
    conda:
        "../envs/train.yaml"
    shell:
        CPU_ONLY
        + "python {input.script} --summary {input.summary} --out {output} > {log} 2>&1"
