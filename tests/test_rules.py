"""The job table of rules/common.smk names every job's pieces: each must be where it says."""

import re
from pathlib import Path

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


def test_each_job_has_its_rule_script_and_library_where_the_table_says():
    for job in job_table():
        name = job["name"]
        assert name in rules_in(ROOT / "rules" / f"{job['stage']}.smk"), name
        assert (ROOT / "scripts" / f"{name}.py").is_file(), name
        assert (ROOT / "eagle3lib" / f"{job['library']}.py").is_file(), name


def test_every_rule_is_a_job_of_the_table_and_every_rules_file_is_included():
    rule_files = sorted((ROOT / "rules").glob("*.smk"))
    rules = {rule for path in rule_files for rule in rules_in(path)}
    assert rules == {job["name"] for job in job_table()}
    snakefile = (ROOT / "Snakefile").read_text()
    for path in rule_files:
        assert f'include: "rules/{path.name}"' in snakefile, path.name
