"""Build EAGLE-3 draft models as a reproducible Snakemake workflow.

One module per stage: data, hidden_states, vocab, train, checkpoint, evaluate, gpu, report;
verifier holds loading and identity of the verifier model, config the typed configuration.
"""

__version__ = "0.1.0"
