"""Every patch to speculators and vLLM (``eagle3lib.speculators_compat.PATCHES``) is pinned to
the upstream version and source it was written against, and is undone when its block ends."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect

import pytest
import torch

from eagle3lib import speculators_compat
from eagle3lib.speculators_compat import PATCHES, Patch, resolve, speculators_patches

# sha256 of inspect.getsource(upstream object) of every entry, as it was when written.
PINNED_SOURCES = {
    "speculators.train.trainer.Trainer.__init__": (
        "c323c45e45491c7375a0ba3af91f5494af7ba21d57dd39ce4fdd6f78c78fcd6d"
    ),
    "speculators.train.trainer._StepTimer": (
        "68fbf864caa0af854ec929c9d35fb7ccb273b517ec34c554c2c9bd5c22329c8e"
    ),
    "speculators.train.checkpointer.get_current_device": (
        "68b44f84e1897e958d90be746d444d5df9096b6b89db5aff7f2642e134571a2e"
    ),
    "speculators.train.optimizers.build_optimizers": (
        "e627c8b541ff50580f6955d797a23edd574ff6ac5d23a8961f7b88dcfc6a88b4"
    ),
    "speculators.models.eagle3.metrics.compute_accuracy_single_step": (
        "1768216ecec64c9a98153593647b0e5387d9dedd1b02c9e5cce432b50c3f54d0"
    ),
    "speculators.models.eagle3.metrics": (
        "2fc4f26f9917c7a56db409c54431e3a69da737ad6cc153af2012c82412727ccd"
    ),
    "speculators.models.eagle3.core": (
        "5ff09e9f983dc0520e949a7647d10fccc393a461e62b73c538c59f40e747b9bc"
    ),
    "speculators.train.checkpointer.BaseCheckpointer.save_checkpoint": (
        "9e6366c2875d7626092ce484eb56f68369fd395829c7e4c7e8959eaab53d3264"
    ),
    "speculators.train.trainer.Trainer.maybe_save_checkpoint": (
        "a47374ee736fb108fe596b1b3474140276790abc77536fac263476cd4f11efce"
    ),
    "speculators.utils.loading.load_model_layers": (
        "ea974cfab0fce32a2945924f3ce56131edd0a26e6a0c4ecc1df7f4b96e4cca4b"
    ),
    "speculators.train.trainer.Trainer._setup_model_ddp": (
        "ab75cdbea20ae2bcddaa8eec28bdc3e8215624c2afb9f07b71782d18789a2cf9"
    ),
    "speculators.train.distributed.maybe_setup_distributed": (
        "ce8ff9c12a247fe797346cfd7b3fc852c6f2b0632676a01249b02fe9f77acf8c"
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector."
    "ExampleHiddenStatesConnector._submit_async_write": (
        "c78aab32eff848cba501928c496174b513f25ddb239558022607beb69320d550"
    ),
}


def importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def recheck(patch: Patch, installed: str) -> str:
    return (
        f"{patch.target}: written for {patch.written_for}, installed {installed}; "
        f"re-check the patch {patch.name}: why={patch.why}"
    )


def entry_param(patch: Patch):
    marks = []
    if not importable(patch.package):
        marks.append(
            pytest.mark.skip(
                reason=f"{patch.package} is not installed in this environment (vLLM lives in "
                "its own venv, .venv-vllm): its patch is checked where it is importable"
            )
        )
    return pytest.param(patch, id=f"{patch.name}:{patch.target}", marks=marks)


ENTRIES = [entry_param(p) for p in PATCHES]


@pytest.mark.parametrize("patch", ENTRIES)
def test_installed_version_is_the_one_patched(patch):
    package, version = patch.written_for.split()
    installed = importlib.metadata.version(package)
    assert installed == version, recheck(patch, f"{package} {installed}")


@pytest.mark.parametrize("patch", ENTRIES)
def test_patched_upstream_source_is_unchanged(patch):
    source = inspect.getsource(speculators_compat.upstream_object(patch.upstream))
    digest = hashlib.sha256(source.encode()).hexdigest()
    package = patch.written_for.split()[0]
    installed = f"{package} {importlib.metadata.version(package)} (source of {patch.upstream})"
    assert digest == PINNED_SOURCES.get(patch.upstream), recheck(patch, installed)


def test_every_target_exists_and_names_are_grouped():
    names = {p.name for p in PATCHES}
    assert len({p.target + str(p.on) + p.name for p in PATCHES}) == len(PATCHES)
    for patch in PATCHES:
        if importable(patch.package) and patch.on is None:
            owner, attr = resolve(patch.target)
            assert hasattr(owner, attr), patch.target
    with pytest.raises(KeyError, match="no patch named"), speculators_patches("not_a_patch"):
        pass
    assert "sync_free_eagle3" in names


def module_attributes(*names: str) -> dict[str, object]:
    """The current value of every module attribute the entries of ``names`` replace."""
    return {
        p.target: getattr(*resolve(p.target))
        for p in speculators_compat.entries(*names)
        if p.on is None
    }


MODULE_PATCHES = ("cpu_trainer", "sync_free_eagle3", "fused_adamw", "resolved_verifier_weights")


def test_patches_are_applied_and_restored_even_when_the_body_raises():
    before = module_attributes(*MODULE_PATCHES)
    context = {"record": {"load_path": "x"}, "tensors": {}}
    raised = pytest.raises(RuntimeError, match="body failed")
    with raised, speculators_patches(*MODULE_PATCHES, **context):
        during = module_attributes(*MODULE_PATCHES)
        assert all(during[t] is not before[t] for t in before)
        raise RuntimeError("body failed")
    after = module_attributes(*MODULE_PATCHES)
    assert all(after[t] is before[t] for t in before)


def test_patches_on_an_object_are_removed_afterwards():
    """An instance attribute that shadowed the class's method is gone again; one the instance
    already had is put back."""
    from speculators.train.checkpointer import SingleGPUCheckpointer

    checkpointer = SingleGPUCheckpointer("unused")
    method = checkpointer.save_checkpoint
    with pytest.raises(RuntimeError), speculators_patches("fp32_state", checkpointer=checkpointer):
        assert checkpointer.save_checkpoint.keywords == {"float_dtype": torch.float32}
        raise RuntimeError
    assert "save_checkpoint" not in vars(checkpointer)
    assert checkpointer.save_checkpoint == method

    def own(*_args, **_kwargs):
        """An instance attribute of its own."""

    checkpointer.save_checkpoint = own
    with speculators_patches("fp32_state", checkpointer=checkpointer):
        assert checkpointer.save_checkpoint is not own
    assert checkpointer.save_checkpoint is own


def test_a_failing_replacement_restores_what_was_applied():
    """The block is never entered when building a replacement fails (here: a missing context
    value); the entries applied before it are undone."""
    before = module_attributes("gloo_group")
    with pytest.raises(KeyError, match="rank"), speculators_patches("gloo_group", local_rank=0):
        pytest.fail("entered")
    assert module_attributes("gloo_group") == before
