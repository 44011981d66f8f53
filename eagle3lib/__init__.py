"""Build EAGLE-3 draft models as a reproducible Snakemake workflow.

One module per stage: data, hidden_states, vocab, train, checkpoint, evaluate, gpu, report;
verifier holds loading and identity of the verifier model, config the typed configuration.
The shard file format is shards (written by shard_writer); training reads it through
train_data and runs streaming_trainer; every change made to speculators or vLLM is listed in
speculators_compat.
"""

__version__ = "0.1.0"
