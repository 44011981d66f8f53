rule verifier:
    """Make the verifier loadable (a packaged GGUF becomes an HF folder) and record its identity."""
    input:
        verifier_inputs,
        script=script("verifier.py"),
    output:
        record=VERIFIER,
        provenance=PROVENANCE["verifier"],
    log:
        log("verifier"),
    benchmark:
        benchmark("verifier")
    conda:
        "../envs/train.yaml"
    params:
        verifier=section("verifier"),
        stamp=stamp("verifier"),
        hf_dir=VERIFIER_HF,
    shell:
        CPU_ONLY
        + "python {input.script} --verifier {params.verifier:q} --hf-dir {params.hf_dir}"
        " --out {output.record} --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"
