rule extract:
    """Hidden states of one shard: aux layers and the final layer's pre-norm output, bf16 or fp8
    (extract.storage)."""
    input:
        verifier=VERIFIER,
        samples=SAMPLES,
        info=SAMPLES_INFO,
        script=script("extract.py"),
        gpu_job=script("gpu_job.py"),
        sharing=extract_sharing_allowed,
        vllm=vllm_interpreter_runs("extract"),
    output:
        shard=SHARD,
        manifest=SHARD_MANIFEST,
        gpu=gpu_record("extract-{shard}"),
        provenance=PROVENANCE["extract"],
    log:
        log("extract-{shard}"),
    benchmark:
        benchmark("extract-{shard}")
    conda:
        "../envs/train.yaml"
    threads: 4
    resources:
        gpu=extract_gpus(),
    params:
        extract=extract_section(),
        stamp=stamp("extract"),
        engine=vllm_engine("extract")["engine"],
        python=vllm_engine("extract")["python"],
    shell:
        gpu_job("extract")
        + " python {input.script} --verifier {input.verifier} --samples {input.samples}"
        " --info {input.info} --shard {wildcards.shard} --extract {params.extract:q}"
        " --threads {threads} --out-shard {output.shard} --out-manifest {output.manifest}"
        " --vllm {params.engine:q} --vllm-python {params.python}"
        " --provenance {output.provenance} --stamp {params.stamp:q}"
        " > {log} 2>&1"
