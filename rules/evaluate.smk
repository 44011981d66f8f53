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
    params:
        stamp=stamp("check_checkpoint"),
    shell:
        CPU_ONLY
        + "python {input.script} --verifier {input.verifier} --config {input.config}"
        " --manifest {input.manifest} --out {output.report}"
        " --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"


rule evaluate:
    """Offline acceptance: greedy chain speculative decoding of held-out prompts with the verifier."""
    input:
        verifier=VERIFIER,
        config=CHECKPOINT_CONFIG,
        weights=CHECKPOINT_WEIGHTS,
        manifest=expand(SHARD_MANIFEST, shard=0),
        prompts=eval_files(),
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
        gpu=gpu_count("evaluate"),
    params:
        evaluate=section("evaluate"),
        stamp=stamp("evaluate"),
        eval_sets=json.dumps(eval_sets()),
    shell:
        gpu_job("evaluate")
        + " python {input.script} --verifier {input.verifier} --config {input.config}"
        " --manifest {input.manifest} --eval-sets {params.eval_sets:q}"
        " --evaluate {params.evaluate:q}"
        " --threads {threads} --out {output.acceptance}"
        " --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"


rule serve_check:
    """vLLM with the verifier and the draft (eagle3): acceptance from /metrics, text vs greedy."""
    input:
        verifier=VERIFIER,
        config=CHECKPOINT_CONFIG,
        weights=CHECKPOINT_WEIGHTS,
        prompts=data_file("eval"),
        script=script("serve_check.py"),
        gpu_job=script("gpu_job.py"),
        vllm=vllm_interpreter_runs("serve_check"),
    output:
        acceptance=VLLM_ACCEPTANCE,
        gpu=gpu_record("serve_check"),
        provenance=PROVENANCE["serve_check"],
    log:
        log("serve_check"),
    benchmark:
        benchmark("serve_check")
    conda:
        "../envs/vllm.yaml"
    threads: 4
    resources:
        gpu=gpu_count("serve_check"),
    params:
        evaluate=serve_check_evaluate(),
        stamp=stamp("serve_check"),
        engine=section("vllm"),
        python=vllm_python(),
        max_prompts=config["data"]["eval"]["max_prompts"] or 0,
        server_log=log("serve_check-server"),
    shell:
        gpu_job("serve_check")
        + " {params.python} {input.script} --verifier {input.verifier} --config {input.config}"
        " --prompts {input.prompts} --max-prompts {params.max_prompts}"
        " --evaluate {params.evaluate:q} --vllm {params.engine:q}"
        " --vllm-python {params.python} --server-log {params.server_log}"
        " --out {output.acceptance}"
        " --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"
