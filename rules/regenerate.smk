rule regenerate:
    """Assistant turns rewritten by the verifier, turn by turn (hf or vllm backend)."""
    input:
        verifier=VERIFIER,
        train=train_files(),
        script=script("regenerate.py"),
        gpu_job=script("gpu_job.py"),
        vllm=vllm_interpreter_runs("regenerate"),
    output:
        conversations=REGENERATED,
        info=REGENERATED_INFO,
        gpu=gpu_record("regenerate"),
        provenance=PROVENANCE["regenerate"],
    log:
        log("regenerate"),
    benchmark:
        benchmark("regenerate")
    conda:
        "../envs/train.yaml"
    threads: 4
    resources:
        gpu=gpu_count("regenerate"),
        workers=config["regenerate"]["workers"],
    params:
        data=regenerate_data(),
        stamp=stamp("regenerate"),
        regenerate=regenerate_section(),
        engine=vllm_engine("regenerate")["engine"],
        python=vllm_engine("regenerate")["python"],
        work=REGENERATE_WORK,
        server_log=log("regenerate-server"),
    shell:
        gpu_job("regenerate")
        + " python {input.script} --verifier {input.verifier} --train {input.train}"
        " --data {params.data:q} --regenerate {params.regenerate:q} --vllm {params.engine:q}"
        " --vllm-python {params.python} --work-dir {params.work}"
        " --server-log {params.server_log} --threads {threads} --workers {resources.workers}"
        " --out {output.conversations} --out-info {output.info}"
        " --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"
