rule check_checkpoint:
    """Checkpoint format: config fields, tensors vs config, d2t/t2d, reload and one forward."""
    input:
        verifier=VERIFIER,
        config=CHECKPOINT_CONFIG,
        weights=CHECKPOINT_WEIGHTS,
        manifest=expand(SHARD_MANIFEST, shard=0),
        script=script("check_checkpoint.py"),
    output:
        report=CHECKPOINT_REPORT,
        provenance=PROVENANCE["check_checkpoint"],
    log:
        log("check_checkpoint"),
    conda:
        "../envs/train.yaml"
    shell:
        "python {input.script} --verifier {input.verifier} --config {input.config}"
        " --manifest {input.manifest} --out {output.report}"
        " --provenance {output.provenance} > {log} 2>&1"


rule evaluate:
    """Offline acceptance: greedy chain speculative decoding of held-out prompts with the verifier."""
    input:
        verifier=VERIFIER,
        config=CHECKPOINT_CONFIG,
        weights=CHECKPOINT_WEIGHTS,
        manifest=expand(SHARD_MANIFEST, shard=0),
        prompts=data_file("eval"),
        script=script("evaluate.py"),
        gpu_job=script("gpu_job.py"),
    output:
        acceptance=ACCEPTANCE,
        gpu=gpu_record("evaluate"),
        provenance=PROVENANCE["evaluate"],
    log:
        log("evaluate"),
    benchmark:
        benchmark("evaluate")
    conda:
        "../envs/train.yaml"
    threads: 4
    resources:
        gpu=config["evaluate"]["gpus"],
    params:
        evaluate=section("evaluate"),
        max_prompts=config["data"]["eval"]["max_prompts"] or 0,
    shell:
        "python {input.gpu_job} --gpus {resources.gpu} --rule evaluate --record {output.gpu} --"
        " python {input.script} --verifier {input.verifier} --config {input.config}"
        " --manifest {input.manifest} --prompts {input.prompts}"
        " --max-prompts {params.max_prompts} --evaluate {params.evaluate:q}"
        " --threads {threads} --out {output.acceptance}"
        " --provenance {output.provenance} > {log} 2>&1"
