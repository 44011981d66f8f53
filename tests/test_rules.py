"""The job table of rules/common.smk names every job's pieces: each must be where it says."""

import re
from pathlib import Path

from eagle3lib.gpu import gpu_setting

ROOT = Path(__file__).resolve().parents[1]


def job_table() -> list[dict]:
    """JOBS of rules/common.smk, each Job(...) as a dict of its arguments."""
    text = (ROOT / "rules" / "common.smk").read_text()
    start = text.index("JOBS = (")
    end = text.index("\n)\n", start) + 2

    def job(name, stage, library, folder, **options):
        return {"name": name, "stage": stage, "library": library, "folder": folder, **options}

    namespace = {"Job": job}
    exec(text[start:end], namespace)  # the table is literals and Job(...) calls only
    return list(namespace["JOBS"])


def rules_in(path: Path) -> list[str]:
    return re.findall(r"^rule (\w+):", path.read_text(), flags=re.MULTILINE)


def rule_text(stage: str, name: str) -> str:
    """The text of rule ``name`` in rules/<stage>.smk, up to the next rule."""
    text = (ROOT / "rules" / f"{stage}.smk").read_text()
    return text.split(f"rule {name}:", 1)[1].split("\nrule ", 1)[0]


def test_each_job_has_its_rule_script_and_library_where_the_table_says():
    for job in job_table():
        name = job["name"]
        assert name in rules_in(ROOT / "rules" / f"{job['stage']}.smk"), name
        assert (ROOT / "scripts" / f"{name}.py").is_file(), name
        assert (ROOT / "eagle3lib" / job["library"]).is_file(), name


def test_every_rule_is_a_job_of_the_table_and_every_rules_file_is_included():
    rule_files = sorted((ROOT / "rules").glob("*.smk"))
    rules = {rule for path in rule_files for rule in rules_in(path)}
    assert rules == {job["name"] for job in job_table()}
    snakefile = (ROOT / "Snakefile").read_text()
    for path in rule_files:
        assert f'include: "rules/{path.name}"' in snakefile, path.name


def test_the_gpu_jobs_of_the_table_and_only_they_start_with_gpu_job():
    for job in job_table():
        text = rule_text(job["stage"], job["name"])
        if job.get("gpus"):
            assert f'gpu_job("{job["name"]}"' in text, job["name"]
            declared = (f'gpu_count("{job["name"]}")', "train_resources()", "extract_gpus()")
            assert any(d in text for d in declared), job["name"]
            # the wrapper names this key when the job sees too few GPUs (eagle3lib/gpu.py)
            assert gpu_setting(job["name"]) == job["gpus"], job["name"]
        else:
            assert "gpu_job(" not in text and "gpu=" not in text, job["name"]


def test_the_python_lists_of_run_folders_are_the_job_tables():
    """preflight.RUN_FOLDERS (checked before a run writes) and report.STAGE_DIRS (sized in the
    summary) are written out in Python; they hold every job's folder of the table and every
    folder that a path of rules/common.smk names under results/<run>/, and nothing else (but
    reports/, which the report job would size before writing its own files there)."""
    from eagle3lib import preflight, report

    text = (ROOT / "rules" / "common.smk").read_text()
    named = set(re.findall(r'results\(f?"([^"/{]+)/', text))
    folders = {job["folder"] for job in job_table()}
    assert folders <= named
    assert set(preflight.RUN_FOLDERS) == named | {".locks"}
    assert set(report.STAGE_DIRS) == (folders | {"train"}) - {"reports"}
