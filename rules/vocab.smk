rule vocab:
    """d2t/t2d: the draft_vocab_size most frequent supervised tokens."""
    input:
        samples=SAMPLES,
        script=script("vocab.py"),
    output:
        vocab_map=VOCAB_MAP,
        info=VOCAB_INFO,
        provenance=PROVENANCE["vocab"],
    log:
        log("vocab"),
    benchmark:
        benchmark("vocab")
    conda:
        "../envs/train.yaml"
    params:
        draft_vocab_size=config["train"]["draft_vocab_size"],
        stamp=stamp("vocab"),
    shell:
        CPU_ONLY + "python {input.script} --samples {input.samples}"
        " --draft-vocab-size {params.draft_vocab_size}"
        " --out-map {output.vocab_map} --out-info {output.info}"
        " --provenance {output.provenance} --stamp {params.stamp:q} > {log} 2>&1"
