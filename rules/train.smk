rule train:
    """Train the draft with speculators from the shards; export a portable checkpoint.

    The log gets all output; the terminal the progress lines (steps, tokens/s, time left).
    """
    input:
        verifier=VERIFIER,
        shards=shards(),
        manifests=shard_manifests(),
        vocab_map=VOCAB_MAP,
        script=script("train.py"),
        gpu_job=script("gpu_job.py"),
        nodes=train_nodes_allowed,
    output:
        config=CHECKPOINT_CONFIG,
        weights=CHECKPOINT_WEIGHTS,
        card=CHECKPOINT_CARD,
        summary=TRAIN_SUMMARY,
        gpu=gpu_record("train"),
        provenance=PROVENANCE["train"],
    log:
        log("train"),
    benchmark:
        benchmark("train")
    conda:
        "../envs/train.yaml"
    threads: train_threads()
    resources:
        **train_resources(),
    params:
        train=train_section(),
        stamp=stamp("train"),
        state=TRAIN_STATE,
    shell:
        gpu_job("train", nodes=True, echo="train: step .*")
        + " python {input.script} --verifier {input.verifier} --shards {input.shards}"
        " --manifests {input.manifests} --vocab-map {input.vocab_map}"
        " --train {params.train:q} --state-dir {params.state} --gpus {resources.gpu}"
        " --nodes {resources.nodes} --node-gpus {resources.node_gpus}"
        " --threads {threads} --loader-threads {resources.loader_threads}"
        " --loader-workers {resources.loader_workers}"
        " --keep-states {resources.keep_states}"
        " --out-config {output.config} --out-weights {output.weights}"
        " --out-card {output.card} --out-summary {output.summary}"
        " --provenance {output.provenance} --stamp {params.stamp:q}"
