"""reports/summary.md and tables.html: the summary (eagle3lib/report.py) written for people."""

from __future__ import annotations

from html import escape
from typing import Any

from eagle3lib.report import VLLM_MAX_POSITION_DIFFERENCE, VLLM_MAX_RELATIVE_DIFFERENCE, fmt


def trust_note(verifier: dict[str, Any]) -> str:
    """'' unless the verifier was loaded with trust_remote_code; then whether its code ran."""
    if not verifier.get("trust_remote_code"):
        return ""
    ran = "its own code ran" if verifier.get("custom_code") else "it ships no custom code"
    return f"; `verifier.trust_remote_code: true` ({ran})"


def text_check(summary: dict[str, Any]) -> str:
    """Whether the text equals verifier-only greedy decoding; under replay, the argmax agreement."""
    if summary["text_matches_verifier"] is None:
        agreement = summary["acceptance"].get("argmax_agreement")
        return f"not checked (replay; verifier argmax agreement {fmt(agreement, 4)})"
    return str(summary["text_matches_verifier"])


def positions(rates: list[float | None] | None) -> str:
    """Per-position (or per-step) rates as one comma-separated figure list."""
    return ", ".join(fmt(p) for p in rates) if rates else "n/a"


def validation_accuracy(training: dict[str, Any]) -> list[float]:
    """The last validation's ``full_acc_j`` per TTT step j (held-out training data)."""
    val = (training.get("val") or [{}])[-1]
    steps = sorted(int(k.split("_")[2]) for k in val if k.startswith("full_acc_"))
    return [val[f"full_acc_{j}_epoch"] for j in steps]


def truncated_note(data: dict[str, Any]) -> str:
    """How many kept samples data.max_length cut (data.truncation: truncate)."""
    return f" ({data['truncated']} cut to data.max_length)" if data.get("truncated") else ""


def training_length(training: dict[str, Any]) -> str:
    """The epochs the train job was set to run, and train.max_steps where set (it may stop
    the training before their end)."""
    epochs = f"{training.get('epochs', '?')} epochs"
    if training.get("max_steps") is None:
        return epochs
    return f"{epochs} (at most {training['max_steps']} steps: train.max_steps)"


def training_row(training: dict[str, Any]) -> list[str]:
    """The train job's split and setting, as its summary has them."""
    if "train_samples" not in training:
        return []
    optimizers = " and ".join(training.get("optimizers") or []) or "?"
    return [
        f"| training | {training_length(training)} on {training['train_samples']} "
        f"samples ({training.get('val_samples', 0)} held out for validation), {optimizers}, "
        f"{training.get('dtype', '?')} on {training.get('device', '?')} |"
    ]


# the train summary's phase_seconds (eagle3lib.streaming_trainer.PHASES), in the order they run
PHASE_LABELS = {
    "steps": "steps",
    "saves": "saves",
    "validation": "validation",
    "best": "marking the best epoch",
}


def training_time(training: dict[str, Any], rest: bool = False) -> str | None:
    """Where the train job's time went, from its summary's ``phase_seconds``, the first step
    inside the steps; ``rest``: what the phases leave of its ``seconds`` (the trainer's
    set-up, waits at barriers); then torch.compile's seconds, in whichever phase they fell.
    None for a summary without them."""
    phases = training.get("phase_seconds")
    if not phases:
        return None
    first, compiling = training.get("first_step_seconds"), training.get("compile_seconds")
    parts = [
        f"{PHASE_LABELS.get(name, name)} {phases[name]:.1f} s"
        + (f" (the first {first:.1f} s)" if name == "steps" and first is not None else "")
        for name in [*PHASE_LABELS, *sorted(set(phases) - set(PHASE_LABELS))]
        if name in phases
    ]
    if rest:
        parts.append(f"set-up and the rest {training['seconds'] - sum(phases.values()):.1f} s")
    split = ", ".join(parts)
    return split + (f"; torch.compile {compiling:.1f} s of it" if compiling else "")


def training_time_row(training: dict[str, Any]) -> list[str]:
    """The train job's time by phase, as a row of the summary's table."""
    split = training_time(training, rest=True)
    if split is None:
        return []
    return [f"| training time | {training['seconds']:.1f} s: {split} |"]


def acceptance_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """[eval set, k, acceptance length, per-position acceptance, per-token accuracy, share of
    generated tokens outside the draft's vocabulary, prompts, steps] per result."""
    return [
        [
            r["eval_set"],
            r["k"],
            fmt(r["acceptance_length"], 4),
            positions(r["per_position_acceptance"]),
            positions(r.get("per_token_accuracy")),
            fmt(r.get("out_of_draft_vocab")),
            r["prompts"],
            r["steps"],
        ]
        for r in summary["acceptance"].get("results", [])
    ]


ACCEPTANCE_HEADERS = [
    "eval set",
    "k",
    "acceptance length",
    "per position",
    "per token (teacher-forced)",
    "outside the draft's vocabulary",
    "prompts",
    "steps",
]


def sources_row(data: dict[str, Any]) -> list[str]:
    """The samples of each training file, where there were several (data.extra_train)."""
    sources = data.get("sources")
    if not sources:
        return []
    kept = ", ".join(f"{s['path']} {s['samples']} of {s['records_read']}" for s in sources)
    return [f"| training samples per file (of the records read) | {kept} |"]


def overlap_row(data: dict[str, Any]) -> list[str]:
    """The report's row of training conversations dropped for overlap with each eval set."""
    overlap = data.get("eval_overlap")
    if not overlap:
        return []
    counts = ", ".join(f"{n} {c}" for n, c in overlap["dropped_per_eval_set"].items())
    repeats = data["dropped"].get("repeated_prompt")
    return [
        f"| training conversations dropped as holding an eval prompt "
        f"(>= {overlap['min_containment']:.0%} of its word {overlap['ngram']}-grams) | {counts} |",
        *(
            [f"| training conversations dropped as repeating a first prompt (dedupe) | {repeats} |"]
            if repeats is not None
            else []
        ),
    ]


# ---- summary.md: one helper per section, each its lines ----------------------------------


def headline_lines(summary: dict[str, Any]) -> list[str]:
    """The title, the verifier, and the table of headline results."""
    acc, verifier = summary["acceptance"], summary["verifier"]
    data, hidden = summary["data"], summary["hidden_states"]
    return [
        f"# EAGLE-3 draft build `{summary['run']}`",
        "",
        f"Verifier **{verifier['name']}** ({verifier['num_hidden_layers']} layers, "
        f"hidden {verifier['hidden_size']}){trust_note(verifier)}.",
        "",
        "| result | value |",
        "|---|---|",
        f"| valid | {'yes' if summary['valid'] else 'NO'}"
        f"{'' if summary.get('min_acceptance_length') else ' (no acceptance gate set)'} |",
        f"| acceptance length ({headline_label(summary)}) | {fmt(acc['acceptance_length'])} |",
        f"| per-position acceptance | {positions(summary['per_position_acceptance'])} |",
        f"| draft accuracy per token of the eval text, teacher-forced (per TTT step) | "
        f"{positions(acc.get('per_token_accuracy'))} |",
        f"| draft accuracy per token of held-out training data (validation's full_acc) | "
        f"{positions(validation_accuracy(summary['training']))} |",
        f"| prompts / verifier steps | {acc['prompts']} / {acc['steps']} |",
        f"| text equals verifier-only greedy | {text_check(summary)} |",
        f"| checkpoint valid | {summary['checkpoint_valid']} |",
        f"| training samples kept / dropped | {data['samples']} / {sum(data['dropped'].values())}"
        f"{truncated_note(data)} |",
        *sources_row(data),
        *training_row(summary["training"]),
        *training_time_row(summary["training"]),
        *overlap_row(data),
        f"| hidden-state tokens / bytes | {hidden['tokens']} / {hidden['bytes']:,} |",
        f"| draft vocab coverage of supervised tokens | {summary['vocab']['token_coverage']:.3f} |",
        "",
    ]


def headline_label(summary: dict[str, Any]) -> str:
    """Which result the headline is: its eval set, k and evaluation method."""
    acc = summary["acceptance"]
    return ", ".join(x for x in (acc.get("eval_set"), f"k={summary['k']}", acc.get("method")) if x)


def eval_set_lines(summary: dict[str, Any]) -> list[str]:
    """The table of every eval set and k, when evaluate measured more than the headline."""
    rows = acceptance_rows(summary)
    if len(rows) <= 1:
        return []
    return [
        f"## Offline acceptance ({summary['acceptance'].get('method', 'decode')})",
        "",
        "| " + " | ".join(ACCEPTANCE_HEADERS) + " |",
        "|" + "---|" * len(ACCEPTANCE_HEADERS),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
        "",
    ]


def category_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(eval set, headers, rows) per eval set whose prompts have categories (MT-bench's):
    a row per k, the acceptance length of each category pooled over its verifier steps."""
    tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
    for r in summary["acceptance"].get("results", []):
        categories = r.get("by_category")
        if not categories:
            continue
        headers = ["k"] + [f"{c} ({v['prompts']})" for c, v in categories.items()]
        row = [r["k"]] + [fmt(v["acceptance_length"], 3) for v in categories.values()]
        tables.setdefault(r["eval_set"], (headers, []))[1].append(row)
    return [(name, headers, rows) for name, (headers, rows) in tables.items()]


def category_lines(summary: dict[str, Any]) -> list[str]:
    """Acceptance length per prompt category, for the eval sets that have categories."""
    lines = []
    for name, headers, rows in category_tables(summary):
        lines += [
            f"## Acceptance length by category: {name} (prompts per category in brackets)",
            "",
            "| " + " | ".join(headers) + " |",
            "|" + "---|" * len(headers),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
            "",
        ]
    return lines


def vllm_lines(summary: dict[str, Any]) -> list[str]:
    """vLLM's acceptance against the offline evaluator's, and how to serve the draft."""
    v = summary.get("vllm")
    if not v:
        return []
    diff = v.get("offline_vs_vllm_relative_difference")
    comparison = (
        f"Acceptance length in vLLM {v['vllm_version']}: {fmt(v['acceptance_length'])} "
        f"(per position {positions(v['per_position_acceptance'])}); "
        f"offline evaluator vs vLLM: {diff:+.1%}, per position at most "
        f"{v['offline_vs_vllm_max_position_difference']:.3f} apart (allowed: "
        f"{VLLM_MAX_RELATIVE_DIFFERENCE:.0%} and {VLLM_MAX_POSITION_DIFFERENCE})."
        if diff is not None
        else ""
    )
    return [
        "## vLLM",
        "",
        comparison,
        "",
        f"Serve it from `results/{summary['run']}/`: `{v['serve_command']}`",
        "",
    ]


def problem_lines(problems: list[str]) -> list[str]:
    """What makes the build invalid, one item each; nothing when it is valid."""
    if not problems:
        return []
    return ["## Problems", ""] + [f"- {p}" for p in problems] + [""]


def gpu_memory_lines(gpu_memory: dict[str, Any]) -> list[str]:
    """Per GPU job (and node): its devices' used MiB before → after, or why there are none."""
    lines = ["## GPU memory (NVML, before/after each GPU-capable job)", ""]
    for job, entry in gpu_memory.items():
        where = f"`{job}` on {entry['host']}" if entry.get("host") else f"`{job}`"
        if not entry["available"]:
            lines.append(f"- {where}: {entry['reason']}")
        else:
            devs = "; ".join(
                f"GPU {d['index']} {d['before_mib']:.0f} → {d['after_mib']:.0f} MiB"
                for d in entry["devices"]
            )
            lines.append(f"- {where}: {devs or 'no GPU leased'}")
    return lines


def time_and_disk_lines(summary: dict[str, Any]) -> list[str]:
    """Wall seconds per benchmarked job, then megabytes per stage folder."""
    return [
        "",
        "## Time per job (s)",
        "",
        *(f"- `{job}`: {s}" for job, s in summary["seconds_per_job"].items()),
        "",
        "## Disk per stage",
        "",
        *(f"- `{stage}`: {size / 1e6:,.1f} MB" for stage, size in summary["disk_bytes"].items()),
    ]


def provenance_lines(provenance: dict[str, Any]) -> list[str]:
    """Per job: its config hash, commit (and whether the tree was dirty), host and GPUs."""
    lines = [
        "",
        "## Provenance",
        "",
        "| job | config sha256 | commit | host | GPUs |",
        "|---|---|---|---|---|",
    ]
    for job, p in provenance.items():
        git = p["git"] or {}
        commit = git.get("commit", "?")[:10] + (" (dirty)" if git.get("dirty") else "")
        lines.append(
            f"| `{job}` | `{p['config_sha256'][:12]}` | `{commit}` | {p['host']} | {', '.join(p['gpus']) or 'none'} |"
        )
    return lines


def plot_lines(plots: dict[str, str]) -> list[str]:
    """A section per plot ({title: file name beside summary.md})."""
    lines = []
    for title, name in plots.items():
        lines += ["", f"## {title}", "", f"![{title}]({name})"]
    return lines


def markdown(summary: dict[str, Any], plots: dict[str, str]) -> str:
    """summary.md: the headline results, then a section per part of the summary, the plots."""
    lines = [
        *headline_lines(summary),
        *eval_set_lines(summary),
        *category_lines(summary),
        *vllm_lines(summary),
        *problem_lines(summary["problems"]),
        *gpu_memory_lines(summary["gpu_memory"]),
        *time_and_disk_lines(summary),
        *provenance_lines(summary["provenance"]),
        *plot_lines(plots),
    ]
    return "\n".join(lines) + "\n"


# ---- tables.html (embedded in `snakemake --report`) --------------------------------------


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def headline_table(summary: dict[str, Any]) -> str:
    """The headline result (the first eval set at its first k) as a one-row table."""
    acc = summary["acceptance"]
    headers = [
        "eval set",
        "method",
        "k",
        "acceptance length",
        "per-position acceptance",
        "prompts",
        "steps",
        "text equals verifier",
    ]
    row = [
        acc.get("eval_set", "-"),
        acc.get("method", "-"),
        summary["k"],
        fmt(summary["acceptance_length"], 4),
        positions(summary["per_position_acceptance"]),
        acc["prompts"],
        acc["steps"],
        text_check(summary),
    ]
    return _table(headers, [row])


def gpu_memory_rows(gpu_memory: dict[str, Any]) -> list[list[Any]]:
    """[job, host, GPU, device / reason, used MiB, leaks]: a row per device, or per job
    without readings."""
    rows = []
    for job, e in gpu_memory.items():
        host, leaks = e.get("host") or "-", ", ".join(e["leaks"]) or "none"
        if not e["available"]:
            rows.append([job, host, "-", e["reason"], "-", leaks])
        for d in e.get("devices", []):
            used = f"{d['before_mib']:.0f} -> {d['after_mib']:.0f}"
            rows.append([job, host, d["index"], d["name"], used, leaks])
    return rows


def provenance_rows(provenance: dict[str, Any]) -> list[list[Any]]:
    """[job, config sha256, commit, host, GPUs] per job."""
    return [
        [
            j,
            p["config_sha256"][:16],
            ((p["git"] or {}).get("commit") or "?")[:12],
            p["host"],
            ", ".join(p["gpus"]) or "none",
        ]
        for j, p in provenance.items()
    ]


HTML_STYLE = "table{border-collapse:collapse;margin:0 0 1.5em}td,th{border:1px solid #bbb;padding:3px 8px;font:13px sans-serif}"


def html_tables(summary: dict[str, Any]) -> str:
    """The report's tables as one HTML page (embedded in `snakemake --report`)."""
    seconds = [[j, s] for j, s in summary["seconds_per_job"].items()]
    disk = [[s, f"{b / 1e6:,.1f}"] for s, b in summary["disk_bytes"].items()]
    gpu_headers = ["job", "host", "GPU", "device / reason", "used MiB", "leaks"]
    sections = [
        ("Acceptance", headline_table(summary)),
        (
            "Offline acceptance per eval set and k",
            _table(ACCEPTANCE_HEADERS, acceptance_rows(summary)),
        ),
        *(
            (f"Acceptance length by category: {name}", _table(headers, rows))
            for name, headers, rows in category_tables(summary)
        ),
        ("Seconds per job", _table(["job", "seconds"], seconds)),
        ("Disk per stage", _table(["stage", "MB"], disk)),
        (
            "GPU memory (NVML, MiB before -> after)",
            _table(gpu_headers, gpu_memory_rows(summary["gpu_memory"])),
        ),
        (
            "Provenance",
            _table(
                ["job", "config sha256", "commit", "host", "GPUs"],
                provenance_rows(summary["provenance"]),
            ),
        ),
        ("Problems", _table(["problem"], [[p] for p in summary["problems"]] or [["none"]])),
    ]
    body = "".join(f"<h3>{title}</h3>{table}" for title, table in sections)
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{HTML_STYLE}</style></head><body>{body}</body></html>\n"
