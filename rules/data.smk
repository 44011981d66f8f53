rule prepare:
    """Tokenize conversations with the verifier's chat template; loss masks on assistant tokens."""
    input:
        verifier=VERIFIER,
        train=train_conversations,
        eval=eval_files(),
        script=script("prepare.py"),
    output:
        samples=SAMPLES,
        info=SAMPLES_INFO,
        provenance=PROVENANCE["prepare"],
    log:
        log("prepare"),
    benchmark:
        benchmark("prepare")
    conda:
        "../envs/train.yaml"
    # tokenizing processes: snakemake gives the job OMP_NUM_THREADS=threads (fewer where fewer
    # cores are given), which prepare.py reads, so the command, and what reruns, is unchanged
    threads: 8
    params:
        data=prepare_section(),
        stamp=stamp("prepare"),
    shell:
        CPU_ONLY
        + "python {input.script} --verifier {input.verifier} --train {input.train}"
        " --eval {input.eval} --data {params.data:q}"
        " --out-samples {output.samples} --out-info {output.info}"
        " --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"
