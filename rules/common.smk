import atexit
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir)))
from eagle3lib.config import acceptance_gate  # noqa: E402
from eagle3lib.config import config_errors, expand_home, resolve_data_path  # noqa: E402
from eagle3lib.config import process_threads  # noqa: E402
from eagle3lib.config import repeated_keys  # noqa: E402
from eagle3lib.config import synthetic_keys_left_out  # noqa: E402
from eagle3lib import preflight  # noqa: E402
from eagle3lib.errors import UserError  # noqa: E402
from eagle3lib.fileio import size_mismatch  # noqa: E402
from eagle3lib.gpu import GPU_SHARING_ENV, sharing_setting  # noqa: E402
from eagle3lib.lifetime import interpreter_first_on_path  # noqa: E402
from eagle3lib.multinode import nodes_refusal, sharing_refusal  # noqa: E402
from eagle3lib.provenance import PlanningEdits, stale_reason  # noqa: E402
from eagle3lib.provenance import stamp as make_stamp  # noqa: E402
from eagle3lib.shards import disk_estimate  # noqa: E402
from eagle3lib.verifier_files import (
    is_gguf_file,
    is_local,
    local_path_problem,
)  # noqa: E402

# Jobs run `python`: this one, unless --sdm conda activates theirs (eagle3lib/lifetime.py).
interpreter_first_on_path()


def fail(message):
    """Stop with a one-line error (no traceback) and a non-zero exit."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


for path in workflow.configfiles:
    for problem in repeated_keys(path):
        fail(problem)
CONFIG_SCHEMA = "schemas/config.schema.yaml"
for problem in config_errors(config, Path(workflow.basedir) / "rules" / CONFIG_SCHEMA):
    fail(problem)
validate(config, schema=CONFIG_SCHEMA, set_default=True)
expand_home(config)

RUN = config["run"]
N_SHARDS = config["extract"]["shards"]

# Jobs that run at once share the cores. torch's OpenMP threads spin while they wait (libgomp's
# default): beside a second busy process on 2 cores a generate call took 10.8 s against 3.3 s
# waiting passively (median; BENCHMARKS.md, "Waiting OpenMP threads"). So they wait passively,
# in every job (jobs inherit this environment; the command text is unchanged). A value the
# user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


wildcard_constraints:
    shard=r"\d+",


# ---- paths: every artifact path is defined here, once ---------------------------------------


def results(path):
    """A path under results/<run>/."""
    return f"results/{RUN}/{path}"


def script(name):
    """A script of this workflow, relative to the working directory, as an ancient input: its
    path is part of the rule's inputs, but its timestamp never triggers a rerun (a fresh clone
    must not rebuild results copied from elsewhere). After editing a script, rerun its rule
    with `-R <rule>`."""
    return ancient(os.path.relpath(Path(workflow.basedir) / "scripts" / name))


VERIFIER = results("verifier/verifier.json")
VERIFIER_HF = results("verifier/hf")
REGENERATED = results("regenerated/conversations.jsonl")
REGENERATED_INFO = results("regenerated/regenerate.json")
REGENERATE_WORK = results("regenerated/chunks")
SAMPLES = results("prepared/samples.safetensors")
SAMPLES_INFO = results("prepared/samples.json")
SHARD = results("hidden_states/shard-{shard}.safetensors")
SHARD_MANIFEST = results("hidden_states/shard-{shard}.json")
VOCAB_MAP = results("vocab/vocab_map.safetensors")
VOCAB_INFO = results("vocab/vocab.json")
TRAIN_STATE = results("train/state")
TRAIN_SUMMARY = results("train/summary.json")
CHECKPOINT = results("checkpoint")
CHECKPOINT_CONFIG = results("checkpoint/config.json")
CHECKPOINT_WEIGHTS = results("checkpoint/model.safetensors")
CHECKPOINT_CARD = results("checkpoint/README.md")
CHECKPOINT_REPORT = results("reports/checkpoint.json")
ACCEPTANCE = results("reports/acceptance.json")
VLLM_ACCEPTANCE = results("reports/vllm_acceptance.json")
SUMMARY = results("reports/summary.json")
SUMMARY_MD = results("reports/summary.md")
PLOT_ACCEPTANCE = results("reports/acceptance.png")
PLOT_LOSS = results("reports/loss.png")
REPORT_TABLES = results("reports/tables.html")
VALIDATION = results("reports/validation.txt")
GPU_RECORD = results("gpu/{job}.json")


# ---- the jobs: one table, from which every list of jobs, folders and GPU needs is made -------


@dataclass(frozen=True)
class Job:
    """A job of the workflow and where its pieces are, all found from its name: its rule
    <name> in rules/<stage>.smk, its command scripts/<name>.py, its library code
    eagle3lib/<library>, its provenance record results/<run>/<folder>/provenance-<name>.json
    (beside its artifacts), its log logs/<name>.log, its benchmark benchmarks/<name>.tsv and
    its GPU record gpu/<name>.json (of a job per shard: <name>-<shard>)."""

    name: str
    stage: str
    library: str
    folder: str
    # config key of the switch that runs it; None: it always runs
    enabled_by: str | None = None
    # config key of its GPU count (its resource gpu); None: a CPU job, its GPUs hidden
    gpus: str | None = None
    per_shard: bool = False
    benchmark: bool = True
    provenance: bool = True


JOBS = (
    Job("verifier", "verifier", "verifier.py", "verifier"),
    Job(
        "regenerate",
        "regenerate",
        "regenerate.py",
        "regenerated",
        enabled_by="regenerate.enabled",
        gpus="regenerate.gpus",
    ),
    Job("prepare", "data", "data.py", "prepared"),
    Job(
        "extract",
        "hidden_states",
        "hidden_states.py",
        "hidden_states",
        gpus="extract.gpus_per_job",
        per_shard=True,
    ),
    Job("vocab", "vocab", "vocab.py", "vocab"),
    Job("train", "train", "train.py", "checkpoint", gpus="train.gpus"),
    Job("check_checkpoint", "evaluate", "checkpoint.py", "reports", benchmark=False),
    Job("evaluate", "evaluate", "evaluate.py", "reports", gpus="evaluate.gpus"),
    Job(
        "serve_check",
        "evaluate",
        "serve.py",
        "reports",
        enabled_by="serve_check.enabled",
        gpus="serve_check.gpus",
    ),
    Job("report", "report", "report.py", "reports", benchmark=False),
    Job(
        "validate", "report", "report.py", "reports", benchmark=False, provenance=False
    ),
)
JOB = {job.name: job for job in JOBS}
# The GPU counts' keys within their sections: resources, not inputs of a job's results.
GPU_COUNTS = tuple(sorted({job.gpus.split(".")[1] for job in JOBS if job.gpus}))


def config_value(key):
    """The value of a dotted config key (section.name)."""
    section, name = key.split(".")
    return config[section][name]


def runs(name):
    """Whether this config runs job ``name``."""
    switch = JOB[name].enabled_by
    return switch is None or config_value(switch)


def running_jobs():
    return [job for job in JOBS if runs(job.name)]


def instances(job):
    """The names of a job's runs: <name>, or <name>-<shard> for each shard."""
    if job.per_shard:
        return [f"{job.name}-{i}" for i in range(N_SHARDS)]
    return [job.name]


def gpu_count(name):
    """The GPUs job ``name`` asks for (its resource gpu)."""
    return config_value(JOB[name].gpus)


def provenance_path(job):
    """provenance-<job>.json beside a job's artifacts (see eagle3lib/provenance.py)."""
    shard = "-{shard}" if job.per_shard else ""
    return results(f"{job.folder}/provenance-{job.name}{shard}.json")


PROVENANCE = {job.name: provenance_path(job) for job in JOBS if job.provenance}
PLANNING_EDITS = PlanningEdits()  # what planning changed, undone where no job ran


def forget_damaged_shards():
    """A shard truncated or replaced since it was built no longer matches its manifest: drop
    the manifest so this run rebuilds the shard (training would refuse it)."""
    for i in range(N_SHARDS):
        shard = Path(SHARD.format(shard=i))
        manifest = Path(SHARD_MANIFEST.format(shard=i))
        problem = size_mismatch(shard, manifest)
        if problem:
            print(f"warning: {problem}; rebuilding shard {i}", file=sys.stderr)
            PLANNING_EDITS.remove(manifest, of=shard)


def print_disk_estimate(facts):
    """Before anything is extracted: the shards' size per token (and in all, once prepare has
    counted the tokens), so the terabytes are known up front (also under `snakemake -n`).
    """
    if all(Path(SHARD_MANIFEST.format(shard=i)).exists() for i in range(N_SHARDS)):
        return
    if facts is None or facts.hidden_size is None:
        return
    aux = config["extract"]["aux_layers"]
    slots = (len(aux) if aux else 3) + 1
    info = Path(SAMPLES_INFO)
    tokens = (
        json.loads(info.read_text(encoding="utf-8")).get("tokens")
        if info.is_file()
        else None
    )
    print(
        disk_estimate(facts.hidden_size, slots, config["extract"]["storage"], tokens),
        file=sys.stderr,
    )


# Every rule's command starts with `exec`: it replaces the shell snakemake starts it in, so the
# job's process is snakemake's own child and, by its parent-death signal, ends with it
# (eagle3lib/lifetime.py).
# Rules without a GPU resource hide the GPUs from their command: a job that initialised CUDA on
# its own would use a device another job leased (and show in that job's NVML record as a leak).
CPU_ONLY = "CUDA_VISIBLE_DEVICES= exec "
# The options of a job over several nodes (train.nodes): its GPUs and threads per node.
NODE_OPTIONS = " --nodes {resources.nodes} --node-gpus {resources.node_gpus} --cpus-per-node {threads}"


def gpu_job(rule, nodes=False, echo=None):
    """The start of a GPU rule's command, up to the `--` that its own command follows:
    scripts/gpu_job.py leases the rule's GPUs (its resource gpu), records their memory in its
    output gpu and runs the command on them. ``nodes``: the job may span several nodes;
    ``echo``: the job writes its own log, and lines matching this pattern also go to the
    terminal. Extract jobs that share GPUs ask snakemake for none (extract_gpus); the
    wrapper finds their lease in the environment (export_gpu_sharing)."""
    node_options = NODE_OPTIONS if nodes else ""
    log_options = f" --log {{log}} --echo '{echo}'" if echo else ""
    return (
        f"exec python {{input.gpu_job}} --gpus {{resources.gpu}}{node_options}"
        f" --rule {rule} --record {{output.gpu}}{log_options} --"
    )


def extract_share():
    """Extract jobs per GPU (extract.jobs_per_gpu) where they have GPUs to share, else 1."""
    extract = config["extract"]
    return extract["jobs_per_gpu"] if extract["gpus_per_job"] else 1


def extract_gpus():
    """The extract rule's resource gpu: none for jobs that share GPUs, whose leases (not
    snakemake's count) cap them at extract.jobs_per_gpu per GPU."""
    return 0 if extract_share() > 1 else gpu_count("extract")


def export_gpu_sharing():
    """Tell scripts/gpu_job.py, through the environment the jobs inherit, that extract jobs
    share their GPUs (how many each leases, how many share one): the rule's command stays the
    same text either way, since a changed command would rerun every shard."""
    if extract_share() > 1:
        os.environ[GPU_SHARING_ENV] = sharing_setting(
            "extract", gpu_count("extract"), extract_share()
        )
    else:
        os.environ.pop(GPU_SHARING_ENV, None)


def extract_sharing_allowed(wildcards):
    """The extract job's input function that adds no input: it stops a run that shares GPUs
    under the slurm executor (known while the DAG is built) with one line."""
    plugin = workflow.executor_plugin
    refusal = sharing_refusal(extract_share(), plugin.name if plugin else None)
    if refusal:
        fail(refusal)
    return []


VLLM_WARNINGS = set()  # those a dry run printed


def vllm_interpreter_runs(job):
    """The input function (adding no input) of a job that may start vLLM. An interpreter
    that cannot run (vllm.python; .venv-vllm not made) stops the run with one line when the
    DAG is built, before the first job, not when this job starts. A process that runs no job
    (a dry run on a machine without vLLM, a login node; --rulegraph, --summary, --report: no
    executor) only warns, once."""

    def check(wildcards):
        for problem in preflight.vllm_python_problems(config, vllm_python(), job):
            if workflow.executor_plugin is not None and not workflow.dryrun:
                fail(problem)
            if problem not in VLLM_WARNINGS:
                VLLM_WARNINGS.add(problem)
                print(f"warning: {problem}", file=sys.stderr)
        return []

    return check


def section(name, drop=GPU_COUNTS):
    """A config section as canonical JSON for a script's command line; as a param it re-runs
    the rule when it changes. GPU counts are resources, not inputs of the result."""
    values = {k: v for k, v in config[name].items() if k not in drop}
    return json.dumps(values, sort_keys=True)


def compile_if_off(name):
    """("compile",) when section ``name``'s compile switch is off: a section carries the key
    only when it is on, so that runs made before the key existed stay current."""
    return () if config[name]["compile"] else ("compile",)


def regenerate_section():
    """The regenerate section as its rule's parameter: GPU and worker counts are resources;
    the synthetic-prompt keys only when prompts are sampled, their system prompts only when
    given, dtype only when not auto (runs made before the keys stay current)."""
    unused = synthetic_keys_left_out(config["regenerate"])
    auto = ("dtype",) if config["regenerate"]["dtype"] == "auto" else ()
    drop = ("gpus", "enabled", "workers", *compile_if_off("regenerate"), *auto, *unused)
    return section("regenerate", drop=drop)


def extract_section():
    """The extract section as its rule's parameter."""
    return section(
        "extract", drop=GPU_COUNTS + ("jobs_per_gpu",) + compile_if_off("extract")
    )


def train_section():
    """The train section as its rule's parameter: GPU, node, loader-thread and loader-worker
    counts are resources (like the GPUs of one node, the nodes set how many processes share
    the work; the loader's threads and worker processes build the same batches); so is
    keep_states (how many epochs' states stay on the disk: nothing trained changes);
    newton_schulz only when not gram and graph_step only when not auto, their defaults (runs
    made before the keys stay current).
    """
    train = config["train"]
    gram = ("newton_schulz",) if train["newton_schulz"] == "gram" else ()
    auto = ("graph_step",) if train["graph_step"] == "auto" else ()
    resource = ("gpus", "nodes", "loader_threads", "loader_workers", "keep_states")
    return section("train", drop=(*resource, *gram, *auto))


def train_threads():
    """The train job's threads: per process (one per GPU of a node) its training thread and
    its batch-loading threads or DataLoader workers (config.process_threads)."""
    train = config["train"]
    processes = max(1, train["gpus"])
    return processes * process_threads(train["loader_threads"], train["loader_workers"])


def train_resources():
    """The train job's resources. On one node its GPUs are the standard `gpu` resource (sbatch
    --gpus=N; the workstation profile's cap may lower it). On several (train.nodes > 1, SLURM
    only) `gpu` is 0 and the GPUs are asked per node, `gres` gpu:N (sbatch --gres counts per
    node, --gpus does not), and the job is an `mpi` job of one task per node: the SLURM
    job-step executor then runs the command without an srun around it, and the command starts
    its own srun step (its `tasks`; with `tasks_per_gpu` 0 the plugin does not turn them into
    --ntasks-per-gpu). `node_gpus` (train.gpus) is the GPUs of each node for the command line;
    no plugin reads it. The command line is the same for any train.nodes: a changed count
    reruns nothing (Snakemake reruns a job whose command text changed). `keep_states`
    (train.keep_states) reaches the command line the same way: it sets what the job leaves
    on the disk, not what it trains, so a changed value reruns nothing either; so do
    `loader_threads` and `loader_workers` (how the batches are built, not which)."""
    train = config["train"]
    resources = {
        "nodes": train["nodes"],
        "node_gpus": train["gpus"],
        "loader_threads": train["loader_threads"],
        "loader_workers": train["loader_workers"],
        "keep_states": train["keep_states"],
    }
    if train["nodes"] == 1:
        return {**resources, "gpu": train["gpus"]}
    resources.update(gpu=0, mpi="srun", tasks=train["nodes"], tasks_per_gpu=0)
    return {**resources, **({"gres": f"gpu:{train['gpus']}"} if train["gpus"] else {})}


def train_nodes_allowed(wildcards):
    """The train job's input function that adds no input: it runs while the DAG is built,
    when the executor is known, and stops a run of train.nodes > 1 without SLURM with one
    line."""
    plugin = workflow.executor_plugin
    refusal = nodes_refusal(
        config["train"]["nodes"], plugin.name if plugin else None, os.environ
    )
    if refusal:
        fail(refusal)
    return []


def train_data():
    """data.train as a rule's parameter: dedupe only when on, so that runs made before the
    key existed stay current."""
    train = dict(config["data"]["train"])
    if not train["dedupe"]:
        del train["dedupe"]
    return train


def prepare_section():
    """What decides the prepared samples (eval files are inputs; their names and prompt counts
    are not). data.extra_train only when given (runs made before the key stay current); with
    regeneration prepare reads the one regenerated file, whose conversations regenerate took
    at most max_samples of each file: with extra files or synthetic prompts (which that file
    holds besides them) no file's options are prepare's, so none of them is cut; with neither,
    data.train's cap leaves that file whole and stays (runs made before stay current).
    """
    data = dict(config["data"], train=train_data())
    extras = data.pop("extra_train")
    regenerated = runs("regenerate")
    if regenerated and (extras or config["regenerate"]["synthetic_prompts"]):
        data["train"] = dict(
            data["train"], max_samples=None, allow_truncated_json=False
        )
    elif extras:
        data["extra_train"] = extras
    data["eval"] = {
        k: v for k, v in data["eval"].items() if k not in ("max_prompts", "name")
    }
    data["extra_eval"] = [
        {k: v for k, v in s.items() if k not in ("max_prompts", "name")}
        for s in data["extra_eval"]
    ]
    return json.dumps(data, sort_keys=True)


def regenerate_data():
    """What decides the regenerated conversations of the data section (not the eval sets);
    data.extra_train only when given."""
    data = dict(config["data"], train=train_data())
    keys = ("train", "max_length", "on_invalid_record")
    keys += ("extra_train",) if data["extra_train"] else ()
    return json.dumps({k: data[k] for k in keys}, sort_keys=True)


def serve_check_evaluate():
    """What serve_check uses of the evaluate section: the headline k, max_new_tokens and the
    dtype (vLLM computes in the offline evaluator's dtype unless vllm.dtype says otherwise).
    """
    k = config["evaluate"]["k"]
    first = k if isinstance(k, int) else k[0]
    keys = ("max_new_tokens", "dtype")
    return json.dumps({"k": first, **{key: config["evaluate"][key] for key in keys}})


def acceptance_gate_json():
    """validate.min_acceptance_length for the report ({eval set: {k: least length}})."""
    gate = acceptance_gate(config["validate"]["min_acceptance_length"])
    return json.dumps(gate, sort_keys=True)


def vllm_python():
    """The vLLM environment's interpreter (relative to the working directory, like scripts)."""
    chosen = config["vllm"]["python"]
    if chosen:
        return chosen
    return os.path.relpath(Path(workflow.basedir) / ".venv-vllm" / "bin" / "python")


def vllm_engine(stage):
    """The vllm section and interpreter for a stage (regenerate, extract) whose backend is
    vllm; nothing for hf, so that vLLM settings never re-run an HF regeneration or
    extraction."""
    if config[stage]["backend"] != "vllm":
        return {"engine": "{}", "python": "none"}
    return {"engine": section("vllm"), "python": vllm_python()}


def train_conversations(wildcards):
    """prepare's conversations: the regenerated ones when data regeneration is on."""
    return REGENERATED if runs("regenerate") else train_files()


def log(name):
    return results(f"logs/{name}.log")


def benchmark(name):
    return results(f"benchmarks/{name}.tsv")


def gpu_record(job):
    return GPU_RECORD.format(job=job)


# ---- inputs resolved from the config ---------------------------------------------------------


def data_file(key):
    """data.<key>.path as a file (package: references resolved); a bad path stops the run."""
    try:
        return str(resolve_data_path(config["data"][key]["path"], f"data.{key}.path"))
    except UserError as exc:
        fail(exc)


def train_file_keys():
    """{config key: file} of data.train and data.extra_train, in order; a bad path stops the
    run."""
    files = {"data.train.path": data_file("train")}
    for i, entry in enumerate(config["data"]["extra_train"]):
        key = f"data.extra_train[{i}].path"
        try:
            files[key] = str(resolve_data_path(entry["path"], key))
        except UserError as exc:
            fail(exc)
    return files


def train_files():
    """The training conversations' files: data.train's, then data.extra_train's."""
    return list(train_file_keys().values())


def eval_sets():
    """[{name, path, max_prompts}]: data.eval first, then data.extra_eval; paths resolved."""
    sets, seen = [], set()
    for key, entry in [("data.eval", config["data"]["eval"])] + [
        (f"data.extra_eval[{i}]", e) for i, e in enumerate(config["data"]["extra_eval"])
    ]:
        if entry["name"] in seen:
            fail(
                f"config key {key}.name: {entry['name']!r} is used twice; give each set its own name"
            )
        seen.add(entry["name"])
        try:
            path = str(resolve_data_path(entry["path"], f"{key}.path"))
        except UserError as exc:
            fail(exc)
        sets.append(
            {"name": entry["name"], "path": path, "max_prompts": entry["max_prompts"]}
        )
    return sets


def eval_files():
    return [s["path"] for s in eval_sets()]


def verifier_inputs(wildcards):
    """A local verifier folder's config.json, or a local GGUF file, so that editing the
    verifier re-runs the build; a local path that cannot be a verifier stops the run."""
    spec = config["verifier"]["path"]
    if spec.startswith("package:") or not is_local(spec):
        return []
    problem = local_path_problem(spec)
    if problem:
        fail(problem)
    return [spec] if is_gguf_file(spec) else [str(Path(spec) / "config.json")]


def shards():
    return expand(SHARD, shard=range(N_SHARDS))


def shard_manifests():
    return expand(SHARD_MANIFEST, shard=range(N_SHARDS))


def gpu_records():
    """{job: its GPU record} of the GPU jobs this config runs."""
    jobs = [job for job in running_jobs() if job.gpus]
    return {name: gpu_record(name) for job in jobs for name in instances(job)}


def benchmarks():
    """{job: its benchmark} of the jobs this config runs that have one."""
    jobs = [job for job in running_jobs() if job.benchmark]
    return {name: benchmark(name) for job in jobs for name in instances(job)}


def stamped_records():
    """{job: its provenance records} of the jobs this config runs."""
    return {
        job.name: expand(PROVENANCE[job.name], shard=range(N_SHARDS))
        for job in running_jobs()
        if job.provenance
    }


def provenance_records():
    """The provenance records the report reads: every job's but the report's own."""
    jobs = stamped_records()
    jobs.pop("report")
    return [record for records in jobs.values() for record in records]


def report_inputs(wildcards):
    return {
        "verifier": VERIFIER,
        "samples_info": SAMPLES_INFO,
        "manifests": shard_manifests(),
        "vocab_info": VOCAB_INFO,
        "train_summary": TRAIN_SUMMARY,
        "checkpoint_report": CHECKPOINT_REPORT,
        "acceptance": ACCEPTANCE,
        "gpu": list(gpu_records().values()),
        "benchmarks": list(benchmarks().values()),
        "provenance": provenance_records(),
        "vllm_acceptance": [VLLM_ACCEPTANCE] if runs("serve_check") else [],
        "regenerated": [REGENERATED_INFO] if runs("regenerate") else [],
        "script": script("report.py"),
    }


def final_targets():
    """The checkpoint, the validated report, and the shards (a deleted shard is rebuilt)."""
    return [
        SUMMARY,
        VALIDATION,
        CHECKPOINT_CONFIG,
        CHECKPOINT_WEIGHTS,
        *shards(),
        *shard_manifests(),
        *([VLLM_ACCEPTANCE] if runs("serve_check") else []),
    ]


# ---- stamps: what made each job's artifacts, checked when the workflow plans -----------------


def eval_specs():
    """{config key: eval set} of data.eval and data.extra_eval, as configured."""
    data = config["data"]
    specs = {"data.eval": data["eval"]}
    specs.update({f"data.extra_eval[{i}]": e for i, e in enumerate(data["extra_eval"])})
    return specs


def stamp(job):
    """What decides the artifacts of ``job`` (canonical JSON): its config subset and the
    fingerprints of the files from outside the run it reads. The job records it in its
    provenance; planning compares it (forget_stale_artifacts)."""
    evals = dict(zip([f"{k}.path" for k in eval_specs()], eval_files()))
    train_data = train_file_keys()
    parts = {
        "verifier": (
            {"verifier": config["verifier"]},
            {f"verifier.path {Path(f).name}": f for f in verifier_inputs(None)},
        ),
        "regenerate": (
            {
                "data": json.loads(regenerate_data()),
                "regenerate": json.loads(regenerate_section()),
                "vllm": json.loads(vllm_engine("regenerate")["engine"]),
            },
            train_data,
        ),
        "prepare": (
            {"data": json.loads(prepare_section())},
            {**({} if runs("regenerate") else train_data), **evals},
        ),
        "extract": (
            {
                "extract": json.loads(extract_section()),
                "vllm": json.loads(vllm_engine("extract")["engine"]),
            },
            {},
        ),
        "vocab": (
            {"train": {"draft_vocab_size": config["train"]["draft_vocab_size"]}},
            {},
        ),
        "train": ({"train": json.loads(train_section())}, {}),
        "check_checkpoint": ({}, {}),
        "evaluate": (
            {"evaluate": json.loads(section("evaluate")), "eval_sets": eval_specs()},
            evals,
        ),
        "serve_check": (
            {
                "evaluate": json.loads(serve_check_evaluate()),
                "vllm": json.loads(section("vllm")),
                "data.eval": {
                    k: config["data"]["eval"][k] for k in ("path", "max_prompts")
                },
            },
            {"data.eval.path": evals["data.eval.path"]},
        ),
        "report": ({"run": RUN}, {}),
    }
    return make_stamp(*parts[job])


def forget_stale_artifacts():
    """Artifacts made with other settings or input files than this config's (results copied
    without Snakemake's metadata, then the config changed) are made to rebuild: their
    provenance record, one of the job's outputs, gets a timestamp of 1970, so every
    input is newer and Snakemake reruns the job (and what depends on it) in any run that needs
    it; the record's content stays. The verifier has no input that could be newer (its script
    is ancient): a stale verifier.json is deleted and every other record made old, so the
    verifier is rebuilt before anything that reads it."""
    stale = []
    records = stamped_records()
    for job, paths in records.items():
        current = stamp(job)
        for record in paths:
            reason = stale_reason(record, current)
            if reason:
                what = "it and everything after it" if job == "verifier" else job
                print(
                    f"warning: {record}: {reason}; rebuilding {what}", file=sys.stderr
                )
                stale.append(record)
    if PROVENANCE["verifier"] in stale:
        if Path(VERIFIER).exists():
            PLANNING_EDITS.remove(VERIFIER, of=PROVENANCE["verifier"])
        stale = [r for paths in records.values() for r in paths if Path(r).exists()]
    for record in stale:
        PLANNING_EDITS.make_old(record)


def undo_planning_edits():
    """At exit of a process that ran no job (a dry run, --lint, --report, a failed check):
    the files forget_damaged_shards and forget_stale_artifacts changed are put back."""
    if workflow.executor_plugin is None or workflow.dryrun:
        PLANNING_EDITS.undo()


# ---- checks before the first job: mistakes knowable now never cost a run ---------------------


def current_record(job):
    """Whether ``job``'s provenance record is there and current: not marked stale
    (forget_stale_artifacts dates it 1970) and made with this config's stamp."""
    record = Path(PROVENANCE[job])
    return (
        record.is_file()
        and record.stat().st_mtime >= 2
        and not stale_reason(record, stamp(job))
    )


def prepared_samples():
    """How many training samples the current prepare made (samples.json), or None when it has
    not run, or its samples are stale and will be made again: its record or (with
    regeneration, whose stamp holds the training files prepare's leaves out) regenerate's is
    stale, or the verifier or the regenerated conversations are newer than the samples.
    """
    info = Path(SAMPLES_INFO)
    if not (info.is_file() and Path(VERIFIER).is_file()):
        return None
    regenerated = runs("regenerate")
    if not current_record("prepare") or (
        regenerated and not current_record("regenerate")
    ):
        return None
    newer = [VERIFIER, REGENERATED] if regenerated else [VERIFIER]
    if any(
        Path(f).is_file() and info.stat().st_mtime < Path(f).stat().st_mtime
        for f in newer
    ):
        return None  # prepare runs again
    try:
        return int(json.loads(info.read_text(encoding="utf-8"))["samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_before_jobs():
    """eagle3lib/preflight.py on this config: the first problem stops the run in one line.
    Returns the verifier facts it read (for the disk estimate)."""
    sets = [{"key": key, "path": path} for key, path in zip(eval_specs(), eval_files())]
    files = {key: Path(path) for key, path in train_file_keys().items()}
    files.update({f"{s['key']}.path": Path(s["path"]) for s in sets})
    problems, facts = preflight.planning_problems(
        config,
        Path(VERIFIER),
        files,
        sets,
        prepared_samples(),
    )
    for problem in problems:
        fail(problem)
    for warning in preflight.setting_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    return facts


# Only the run that plans the DAG: a job's own snakemake (a cluster job) must not race with
# the extract job that is writing a shard and its manifest. The result folders first: a file
# in their place would stop Snakemake itself with a traceback.
if workflow.is_main_process:
    for problem in preflight.output_path_problems(Path(results(""))):
        fail(problem)
    atexit.register(undo_planning_edits)
    forget_damaged_shards()
    forget_stale_artifacts()
    print_disk_estimate(check_before_jobs())


export_gpu_sharing()
