# EAGLE-3 draft models as a reproducible build: verifier -> prepared samples -> hidden-state
# shards -> vocab map -> trained checkpoint -> validation report. See README.md.
from snakemake.utils import min_version

min_version("9.0")


# config.yaml is the embedded default; a --configfile replaces it instead of merging into it.
if not workflow.config_settings.configfiles:

    configfile: "config.yaml"


report: "rules/report/workflow.rst"


include: "rules/common.smk"
include: "rules/verifier.smk"
include: "rules/regenerate.smk"
include: "rules/data.smk"
include: "rules/hidden_states.smk"
include: "rules/vocab.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        final_targets(),
