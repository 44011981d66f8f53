r"""Benchmark draft training: this project's train stage against speculators' own trainer.

    python bench/train.py --smoke                       # CPU, tiny shapes, a few minutes
    python bench/train.py --steps 60                    # one GPU, Llama-3.1-8B verifier shape
    torchrun --nproc-per-node 2 bench/train.py ...      # DDP over 2 GPUs

Both trainers train the same EAGLE-3 draft (1 layer, hidden 4096, draft vocab 32000, 3 TTT
steps, packed sequences of 2048) on the same synthetic hidden-state shards (lengths uniform in
256-2048) with the same seed; speculators' data path (sampler, CollateFn, shift_batch) and
model are used by both. Variants (``VARIANTS``):

    ours                  eagle3lib.streaming_trainer.StreamingTrainer, AdamW, metrics every 100 steps,
                          batches built by 4 threads (train.loader_threads)
    ours_muon             the workflow's default recipe (Muon, log every 10 steps) with
                          speculators' packing (multipack)
    ours_muon_ffd         the workflow's default recipe: ours_muon with train.packing: ffd
                          (both with train.newton_schulz: gram, the default since 2026-12-05),
                          its step run eagerly (train.graph_step: false; what the default,
                          auto, runs on several GPUs; on one GPU it is ours_muon_ffd_graph)
    ours_muon_ffd_standard ours_muon_ffd with train.newton_schulz: standard (torch's iteration
                          for every matrix, the train job's Muon before 2026-12-05)
    ours_muon_ffd_every_rank ours_muon_ffd whose DDP ranks each orthogonalise every Muon
                          matrix, as the train job did until 2026-12-05 (since, it splits them
                          over the ranks: muon.Ranks); on one GPU the same as ours_muon_ffd
    ours_ffd              ours with train.packing: ffd (the workflow's default since
                          2026-12-04: fuller batches); ours itself packs as speculators does
    ours_fp8              ours on fp8 shards of the same states
    ours_syncs            ours with speculators' loss metrics as they are (8 host syncs a step)
    ours_1thread          ours with one thread running speculators' CollateFn (the old loader)
    ours_workers          ours with speculators' loader, --workers processes
    ours_nobcast          ours whose DDP does not re-send the draft's buffers every step
    ours_muon_ffd_bucketview ours_muon_ffd whose DDP gradients are views of its all-reduce
                          buckets (gradient_as_bucket_view); _nobcast: without DDP's buffer
                          broadcast; _ddpopts: both
    ours_muon_torch       ours_muon with torch's Muon one matrix at a time (as speculators builds
                          it), not batched by shape (eagle3lib.muon.BatchedMuon)
    ours_muon_1loader     ours_muon with one thread building batches (train.loader_threads: 1)
    ours_muon_workers     ours_muon with speculators' loader, --workers processes (batches
                          built outside the training process; a thread of it pins them)
    ours_muon_nscompiled  an experiment: ours_muon with torch's Newton-Schulz function under
                          torch.compile (on an H200 two runs left it unsettled: BENCHMARKS.md)
    ours_muon_ffd_cg      an experiment: ours_muon_ffd with inductor's CUDA graph trees (the
                          compiled regions of the draft's forward and backward replayed as CUDA
                          graphs; a new iteration marked after every step)
    ours_muon_ffd_cppwrap an experiment: ours_muon_ffd with inductor's C++ wrapper launching
                          the compiled kernels (less Python a kernel)
    ours_ffd_graph        ours_ffd with the whole step (forward, backward, clipping, AdamW)
                          captured into one CUDA graph after 3 eager steps and replayed
                          (eagle3lib.graphed_step; train.graph_step: true, and what its
                          default, auto, runs on one GPU since 2026-12-05, seventh session)
    ours_muon_ffd_graph   the same for ours_muon_ffd (Muon's rate a tensor on the device): the
                          workflow's default recipe on one GPU as the train job runs it
                          (a run of these four that fails is printed and listed under
                          "failed" in the summary; the call's other runs go on)
    speculators_w0/w4/w12 speculators.train.trainer.Trainer, AdamW, no per-step logging, its
                          loader (spawned workers, prefetch 4, pinned) with 0, 4, 12 workers
    speculators_fastest   the same with --workers workers (earlier commands)
    speculators_cli       its CLI's defaults: Muon, logging every step, 12 workers

``name+contend`` runs a variant with --contend busy processes (each copying 32 MB arrays: a
core and memory bandwidth, as other jobs of the node) from its first step to the end of its
timed window. --repeat N runs the variant list N times in order, so pairs interleave.
Every run's OpenMP threads wait passively, as in the workflow's jobs (OMP_WAIT_POLICY=PASSIVE
unless set otherwise); ours runs with torch's intra-op threads held to the train job's share
of a GPU (``config.process_threads``: 5 with 4 loader threads), speculators' trainer with
torch's default (until 2026-12-05 every run had torch's default threads and spinning waits).

Real (non-padding) tokens per second are timed between steps --warmup and --steps with the
GPU synchronised at both ends; data wait is the training loop's wait for batches in that
window (ours only); "rq wait" (``training_thread`` in the JSON) the share of the window the
training thread spent runnable but waiting for a core (Linux's schedstat: starved by other
processes), beside the share it ran; "lead ms" (``host_lead_ms``, with its min) the median
over the timed steps of the GPU work still queued when the host ended a step: about a step's
time or more where the GPU set the pace, a few ms where the host launching kernels did.
The summary pairs the i-th runs of: ours and speculators' trainer at its best setting of the
call (highest median of speculators_w0/w4/w12/fastest), ours_ffd and that best, ours_muon and
speculators_cli, ours_muon_ffd and speculators_cli, ours_ffd and ours, ours_muon_ffd_cg and
ours_muon_ffd_cppwrap each with ours_muon_ffd, ours_ffd_graph with ours_ffd (quiet and
contended: graph_step.speedup, graph_step.contended.*), ours_muon_ffd_graph with
ours_muon_ffd and speculators_cli (graph_step.muon.speedup, graph_step.muon.contended.*,
graph_step.muon.speedup_vs_speculators_cli), ours_ffd_graph with speculators' best
(graph_step.speedup_vs_speculators; its median run graph_step.tokens_per_s), ours_muon_ffd+contend with ours_muon_ffd
(muon.contended.*); per comparison every pair's ratio, the min and the median. "gpu wait"
(``gpu_wait_fraction``) is the share of the window the training loop was held back for the
GPU (``StreamingTrainer.steps_in_flight``: at most 2 steps queued ahead), not counted as
data wait; "buf wait" (``buffer_wait_fraction``) the loader threads' wait for a free pinned
buffer set over the window, summed over the threads (the GPU holding the sets).
It prints ``key = value`` lines. #16's keys name the workflow's default packing (ffd), each
also under a name with the packing's (``packing_keys``); the runs with speculators' multipack
print only the latter: train.<gpu>.tokens_per_s (the median ours_ffd run; ffd.tokens_per_s,
and multipack.tokens_per_s for ours), speedup_vs_speculators (min over pairs; ours_ffd, and
multipack.speedup_vs_speculators for ours), muon.speedup_vs_speculators_cli (min;
ours_muon_ffd, and muon_multipack.* for ours_muon), contended.tokens_per_s (median
ours_ffd+contend), contended.data_wait_fraction (max), contended.vs_quiet and
contended.vs_quiet_per_pair (the worst pair), multipack.contended.* for ours+contend,
gram.speedup_vs_standard (min), under DDP muon_split.speedup_vs_every_rank (min), pack_fill
(the default packing over one epoch of the bench's samples), multipack.pack_fill and
ffd.pack_fill; --same-training N adds same_training.max_relative_difference
(ours vs speculators' trainer, first N losses, same batches, logged every step) and the
same for ours with twice the lr (a mutation that must exceed eagle3lib.train's
SAME_TRAINING_BF16_RTOL), with --same-training-optimizer muon as same_training.muon.*
(speculators_muon_w0, ours_muon and ours_muon_lr2x: speculators' Muon against the train
job's); cuda_graphs.speedup and cpp_wrapper.speedup (min), with --log-every
their .max_loss_relative_difference, and the CUDA graphs runs' regions run without graphs;
under torchrun with --baseline, scaling_efficiency per variant, and a line for any run
whose ranks ended with different weights (``ranks_agree``).
Writes bench_train.json (bench_train_ddp2.json) to --out, and after every run
bench_train.partial-<rank>.json (what a call cut short keeps). Each run's wall time is in the
table.

Next GPU measurements (durations are estimates from earlier calls, not measured:
each run builds the draft and, first in a process, compiles it; runs with 12 spawned workers
start more slowly):

  0. one H200 (nvidia-h200), 18 runs (ran on 2026-12-05 in 17 min, BENCHMARKS.md): the
     workflow's default packing (ffd since 2026-12-04) against speculators' trainer at its
     best, and the default recipe whole against its CLI defaults:
       python3 bench/train.py --samples 120 --steps 28 --warmup 8 --profile-steps 0 \
         --repeat 3 \
         --variants ours_ffd,speculators_w0,speculators_w4,speculators_w12,ours_muon_ffd,speculators_cli
  1. one H200 (nvidia-h200), about 6-8 min, 21 runs (ran on 2026-12-01, BENCHMARKS.md): the
     fair baseline, the default recipe and contention (12 busy processes on the 16 cores):
       python3 bench/train.py --samples 120 --steps 28 --warmup 8 --profile-steps 0 \
         --contend 12 --repeat 3 \
         --variants ours,speculators_w0,speculators_w4,speculators_w12,ours_muon,speculators_cli,ours+contend
  2. two H200s (nvidia-h200-x2), perhaps 15 min, 28 runs: 13 on one GPU, 15 DDP (not run
     as one call: ffd packing ran on one H200, the same training on GPU 1 of the x2 host, both
     2026-12-01, BENCHMARKS.md; the DDP part has not run since the sync fix's three calls):
     on GPU 0 the default packing, the default recipe, ours and the old loader under
     contention (24 busy processes on its 32 cores) and same training over 50 steps; then DDP
     of the default recipe (the workflow's train rule) with torch's DDP defaults, with its
     gradients as bucket views, without its buffer broadcast, with both, and without Muon
     split over the ranks, each against the one-GPU run of the call (``scaling_lines``):
       python3 bench/train.py --samples 240 --steps 28 --warmup 8 --profile-steps 0 \
         --contend 24 --repeat 2 --same-training 50 \
         --variants ours,ours_ffd,ours_muon_ffd,ours_ffd+contend,ours_1thread+contend && \
       torchrun --nproc-per-node 2 bench/train.py --samples 240 --steps 28 --warmup 8 \
         --profile-steps 0 --repeat 3 \
         --variants ours_muon_ffd,ours_muon_ffd_bucketview,ours_muon_ffd_nobcast,ours_muon_ffd_ddpopts,ours_muon_ffd_every_rank \
         --baseline /tmp/eagle3-bench-train/bench_train.json
     (queue bench/queues/train-2gpu.txt)
  3. one H200, 7 runs, perhaps 12 min (its first two runs ran on 2026-12-05, BENCHMARKS.md:
     CUDA graphs 9.7 x slower with the same losses, logging every step; every run
     compiles the draft anew: their first steps took 2 min 02 s and 40 s): a SmolLM2-sized
     four-layer draft, whose step is host-bound (GPU busy 38-69 % in the ffd build), with
     the compiled regions launched by inductor's C++ wrapper, against the default recipe;
     first one pair logging every step (the losses compare), then two timed rounds:
       python3 bench/train.py --shape smollm2 --num-layers 4 --samples 1000 --steps 20 \
         --warmup 5 --profile-steps 0 --log-every 1 \
         --variants ours_muon_ffd,ours_muon_ffd_cppwrap && \
       python3 bench/train.py --shape smollm2 --num-layers 4 --samples 1000 --steps 50 \
         --warmup 10 --profile-steps 0 --repeat 2 \
         --variants ours_muon_ffd,ours_muon_ffd_cppwrap,ours_muon_ffd_cg
     (CUDA graphs only in the timed rounds, logging every 10 steps as the default recipe does:
     whether the 9.7 x holds without a sync every step)
  4. one H200, 11 runs and two checks, 12 min of runs (run 2026-12-05 but for the first
     command, which then failed to import eagle3lib; BENCHMARKS.md): Gram Newton-Schulz
     (train.newton_schulz: gram, the default since 2026-12-05) against torch's iteration,
     matrix by matrix at the 8B-shaped draft's shapes, on its optimiser step, and in the
     default recipe against speculators' CLI defaults (#16's 1.6 x):
       python3 bench/newton_schulz.py --shape llama8b && \
       python3 bench/train.py --samples 8 --variants "" --muon-check 20 && \
       python3 bench/train.py --samples 120 --steps 28 --warmup 8 --profile-steps 0 \
         --repeat 3 --variants ours_muon_ffd,ours_muon_ffd_standard,speculators_cli && \
       python3 bench/train.py --samples 240 --steps 50 --warmup 8 --profile-steps 0 \
         --log-every 1 --variants ours_muon_ffd,ours_muon_ffd_standard
     (the last pair logs every step: how far the losses of the two drift apart in 50 steps)
  Plans 4 and 3 are the queue bench/queues/train-gram.txt (bench/gpu_queue.sh).
  5. one H200, 28 runs and two checks, perhaps 22 min: #16's one-GPU pairs again with the
     train job's threads and passive OpenMP waits (ffd under 12 busy processes, 4 pairs; the
     default recipe against speculators' CLI defaults, 4 pairs; the optimiser step alone;
     AdamW against speculators at 0, 4 and 12 workers, 3 pairs), then the first command of
     plan 4: the queue bench/queues/train-threads.txt (its first two entries, 3 pairs each:
     bench/queues/train-threads-short.txt, run on an H100 on 2026-12-05).
  6. one GPU, about 20 min: ours_ffd_graph's losses against ours_ffd's, both quiet and
     beside 12 busy processes, then plan 5's item-1 pairs: bench/queues/train-graph.txt
     (run on an H100 on 2026-12-05, sixth session).
  7. one GPU, about 25 min: the default recipe graphed (ours_muon_ffd_graph): its 50 losses
     against ours_muon_ffd's, quiet and beside 12 busy processes against the eager step,
     against speculators' CLI defaults, and AdamW's graphed step again with the bound on
     steps in flight (data wait), speculators' Muon against the train job's over 50 losses
     (--same-training-optimizer muon), and the workflow's own train job with
     train.graph_step (bench/workflow_gpu.py --graph-step true): bench/queues/train-graph-muon.txt
     (run on an H100 on 2026-12-05, seventh session, but for the workflow's train job).
  8. one GPU, about 25 min: with train.graph_step: auto, the train job's default since the
     seventh session, the workflow at its default over 2 epochs, two eager and two graphed
     AdamW runs' 50 losses (--repeat 2: ours_ffd.repeat, the yardstick for graph_step's
     0.0087), then #16's item 1 with the graphed steps (AdamW
     against speculators at 0, 4 and 12 workers, the default recipe against its CLI
     defaults, 3 pairs): bench/queues/train-auto.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

# As in the workflow's jobs (rules/common.smk): torch's OpenMP threads wait passively instead
# of spinning, which libgomp reads once, before torch loads it. A value set outside is kept
# (OMP_WAIT_POLICY=ACTIVE: spinning). It holds for every variant, speculators' trainer too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from extract import device_tag  # noqa: E402

from eagle3lib.config import TrainConfig, process_threads  # noqa: E402

# torch's intra-op threads in this process before any run changes them: what speculators'
# trainer runs with (ours runs with what the train job sets, ``intra_op_threads``); under
# torchrun with several processes 1, as torchrun sets OMP_NUM_THREADS=1 where it is unset
TORCH_THREADS = torch.get_num_threads()

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
SMOLLM2 = dict(  # SmolLM2-135M-Instruct: the quality preset's verifier (configs/smollm2-gpu.yaml)
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=False,  # the bench verifier stores lm_head on its own
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to train: whose trainer and with what recipe, loader and packing."""

    trainer: str = "ours"  # ours (StreamingTrainer) or speculators (its Trainer)
    optimizer: str = "adamw"
    log_every: int = 100
    workers: int | None = 0  # DataLoader worker processes; None: --workers
    loader_threads: int = 4  # ours without workers: threads building batches
    packing: str = "multipack"
    storage: str = "bf16"
    syncs: bool = False  # speculators' loss metrics with their host syncs
    broadcast_buffers: bool = True  # DDP re-sends the draft's buffers every forward
    bucket_view: bool = False  # DDP's gradients views of its buckets (gradient_as_bucket_view)
    lr_factor: float = 1.0  # a mutation for --same-training
    compiled_ns: bool = False  # an experiment: torch's Muon with its Newton-Schulz compiled
    batched_muon: bool = True  # on a GPU, Muon batched by matrix shape (muon.BatchedMuon)
    muon_across_ranks: bool = True  # with batched_muon under DDP: split over the ranks
    newton_schulz: str = TrainConfig.newton_schulz  # train.newton_schulz (with batched_muon)
    # experiments, not train options: how torch.compile's code launches its kernels on a GPU
    cuda_graphs: bool = False  # inductor's CUDA graph trees (mode "reduce-overhead")
    cpp_wrapper: bool = False  # inductor's C++ wrapper in place of its Python one
    graph_step: bool = False  # the whole step captured into one CUDA graph (graphed_step):
    # set either way here, never the train job's auto

    @property
    def experiment(self) -> bool:
        """A setting that may not work on every GPU: its failure is noted, the call goes on."""
        return self.cuda_graphs or self.cpp_wrapper or self.graph_step


def default_recipe(**changes) -> Variant:
    """Ours with the workflow's default recipe (Muon, log every train.log_every steps,
    train.packing), with ``changes``."""
    return Variant(
        **{"optimizer": "muon", "log_every": TrainConfig.log_every, "packing": TrainConfig.packing}
        | changes
    )


# ``name+contend`` runs ``name`` with --contend busy processes during its timed window.
VARIANTS = {
    # StreamingTrainer, AdamW, metrics every 100 steps, batches built by 4 threads
    "ours": Variant(),
    # the workflow's default recipe (Muon, log every train.log_every (10) steps) with
    # speculators' packing; ours_muon_ffd: with the workflow's default packing too
    "ours_muon": default_recipe(packing="multipack"),
    "ours_muon_ffd": default_recipe(),
    "ours_muon_ffd_standard": default_recipe(newton_schulz="standard"),
    # under torchrun: every rank orthogonalises every Muon matrix (as torch's Muon does)
    "ours_muon_ffd_every_rank": default_recipe(muon_across_ranks=False),
    # an experiment, not a train option: ours_muon with torch's Newton-Schulz function under
    # torch.compile (dynamo turns to dynamic shapes after the second matrix shape: 4 graphs on
    # an H200), to size the host time Muon's eager ops cost
    "ours_muon_nscompiled": default_recipe(
        packing="multipack", compiled_ns=True, batched_muon=False
    ),
    # ours_muon with torch's Muon as speculators builds it (one matrix at a time), as before
    # muon.BatchedMuon
    "ours_muon_torch": default_recipe(packing="multipack", batched_muon=False),
    # the loader of the default recipe: one thread, or worker processes, against 4 threads
    # (a host-bound step shares the GIL with the threads building its batches)
    "ours_muon_1loader": default_recipe(packing="multipack", loader_threads=1),
    "ours_muon_workers": default_recipe(packing="multipack", workers=None),
    # experiments for a host-bound step (a SmolLM2-sized draft): the default recipe whole with
    # its compiled regions replayed as CUDA graphs, or launched from inductor's C++ wrapper
    "ours_muon_ffd_cg": default_recipe(cuda_graphs=True),
    "ours_muon_ffd_cppwrap": default_recipe(cpp_wrapper=True),
    "ours_ffd": Variant(packing="ffd"),  # train.packing: ffd (fuller batches)
    # for a host that slows the step's launches: ours_ffd's step captured into one CUDA graph
    # after 3 eager steps and replayed (train.graph_step: true, auto's choice on one GPU;
    # an experiment here, so that a failed capture does not cost the call's other runs)
    "ours_ffd_graph": Variant(packing="ffd", graph_step=True),
    # the same for the default recipe (Muon's rate a tensor on the device: muon.BatchedMuon)
    "ours_muon_ffd_graph": default_recipe(graph_step=True),
    "ours_fp8": Variant(storage="fp8"),  # fp8 shards of the same states
    "ours_syncs": Variant(syncs=True),  # speculators' metrics with their 8 host syncs a step
    "ours_1thread": Variant(loader_threads=0),  # one thread running speculators' collate
    "ours_workers": Variant(workers=None),  # speculators' loader with --workers processes
    "ours_nobcast": Variant(broadcast_buffers=False),  # under torchrun: DDP without buffer sync
    # under torchrun: the default recipe with DDP's gradients views of its all-reduce buckets
    # (no copies in and out), without its per-step buffer broadcast, and with both
    "ours_muon_ffd_bucketview": default_recipe(bucket_view=True),
    "ours_muon_ffd_nobcast": default_recipe(broadcast_buffers=False),
    "ours_muon_ffd_ddpopts": default_recipe(bucket_view=True, broadcast_buffers=False),
    "ours_lr2x": Variant(lr_factor=2.0),  # a mutation: twice the learning rate
    # --same-training-optimizer muon: ours_muon with twice the rate (a mutation) and
    # speculators' trainer with Muon on the same batches (no workers)
    "ours_muon_lr2x": default_recipe(packing="multipack", lr_factor=2.0),
    "speculators_muon_w0": Variant("speculators", optimizer="muon", log_every=10**9, workers=0),
    # speculators.train.trainer.Trainer, AdamW, no per-step logging, its loader (spawned
    # workers, prefetch 4, pinned) with 0, 4, 12 or --workers workers
    "speculators_w0": Variant("speculators", log_every=10**9, workers=0),
    "speculators_w4": Variant("speculators", log_every=10**9, workers=4),
    "speculators_w12": Variant("speculators", log_every=10**9, workers=12),
    "speculators_fastest": Variant("speculators", log_every=10**9, workers=None),
    # its CLI's defaults: Muon, logging every step, 12 workers
    "speculators_cli": Variant("speculators", optimizer="muon", log_every=1, workers=12),
}
# the variants run beside busy processes (name+contend) that the summary compares with quiet
CONTENDED = ("ours", "ours_ffd", "ours_ffd_graph", "ours_muon_ffd", "ours_muon_ffd_graph")


def contended_prefixes(quiet: str) -> list[str]:
    """The summary keys of ``quiet``+contend against ``quiet``: #16's (contended, by packing)
    for AdamW's eager step; the default recipe's and the graphed steps' their own."""
    v = VARIANTS[quiet]
    muon = "muon." if v.optimizer == "muon" else ""
    if v.graph_step:
        return [f"graph_step.{muon}contended"]
    return [f"{muon}contended"] if muon else packing_keys("contended", v.packing)


SPECULATORS_SETTINGS = (
    "speculators_w0",
    "speculators_w4",
    "speculators_w12",
    "speculators_fastest",
)
CONTEND = "+contend"


def variant(name: str) -> Variant:
    return VARIANTS[name.removesuffix(CONTEND)]


# ChatML, the template the verifier job checks parses (no text is tokenized here)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_verifier(path: Path, shape: dict) -> Path:
    """A verifier folder holding only what the draft needs: config, embeddings, norm, lm_head,
    and a word-level tokenizer with a chat template (the verifier's checks load it)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    if (path / "model.safetensors").exists():  # an earlier run's: reused if of this shape
        saved = json.loads((path / "config.json").read_text())
        if all(saved.get(k) == v for k, v in shape.items()):
            return path
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    words = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    v, h = shape["vocab_size"], shape["hidden_size"]
    save_file(
        {
            "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        },
        str(path / "model.safetensors"),
    )
    return path


def make_shards(
    out: Path, record: dict, lengths: list[int], n_shards: int, seed: int, storage: str = "bf16"
):
    """Synthetic shards in the project's format (random bf16 states, written by ShardWriter;
    the same states, quantized, for fp8 storage)."""
    from eagle3lib import config, shard_writer
    from eagle3lib.fileio import sha256_file, write_json
    from eagle3lib.shards import STORAGE_DTYPES, ShardLayout
    from eagle3lib.verifier import identity

    layers = record["num_hidden_layers"]
    aux = config.resolve_aux_layers(None, layers)
    h = record["hidden_size"]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    shards, manifests = [], []
    for s in range(n_shards):
        part = lengths[s::n_shards]
        path, mpath = out / f"shard-{s}.safetensors", out / f"shard-{s}.json"
        if not mpath.exists():
            layout = ShardLayout(tuple(part), len(aux) + 1, h, storage=storage)
            writer = shard_writer.ShardWriter(
                path, layout, {}, device=device, max_batch_rows=max(part)
            )
            ids = [rng.integers(0, record["vocab_size"], n) for n in part]
            for i, n in enumerate(part):
                states = torch.randn(
                    1, n, len(aux) + 1, h, generator=g, device=device, dtype=torch.bfloat16
                )
                writer.put_batch([i], states, [n])
            writer.close(np.concatenate(ids), np.ones(sum(part), np.uint8))
            write_json(
                mpath,
                {
                    "verifier": identity(record),
                    "layer_ids": [*aux, layers],
                    "hidden_size": h,
                    "state_dtype": STORAGE_DTYPES[storage],
                    "tokens": sum(part),
                    "rejected": [],
                    "file": {
                        "name": path.name,
                        "bytes": path.stat().st_size,
                        "sha256": sha256_file(path),
                    },
                },
            )
        shards.append(path)
        manifests.append(mpath)
    return shards, manifests


# One busy process of --contend: copies and scales 32 MB arrays, a core and memory bandwidth
# taken as another job on the node would (extraction, evaluation, other training).
BUSY = """
import numpy as np
a = np.ones(1 << 22)
b = np.empty_like(a)
print("ready", flush=True)
while True:
    np.copyto(b, a)
    b *= 1.0001
"""


class Busy:
    """``n`` busy processes (``BUSY``), started and stopped by the benchmark."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def start(self) -> None:
        import subprocess

        self.procs = [
            subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
            for _ in range(self.n)
        ]
        for proc in self.procs:  # running before the clock starts
            proc.stdout.readline()

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
            proc.stdout.close()
        self.procs = []


def host_lead(host_ms: list[float], gpu_ms: list[float]) -> dict:
    """How far ahead of the GPU the training thread ran, from each timed step's end: when the
    host had launched the step's last kernel (``host_ms``) and when the GPU finished it
    (``gpu_ms``, a CUDA event's time), both from the window's synchronised start. The lead is
    the GPU work still queued as the host moved on. About a step's time or more: the GPU set
    the pace; only the step's last kernels' time (a few ms): the host launching them did. A
    step that synchronises (a logging step) ends with a lead of about 0."""
    leads = sorted(g - h for h, g in zip(host_ms, gpu_ms, strict=True))
    if not leads:
        return {"steps": 0}
    return {
        "steps": len(leads),
        "min": round(leads[0], 2),
        "median": round(leads[len(leads) // 2], 2),
    }


# StreamingTrainer's waits, in seconds: the training loop's for a batch (data), the training
# loop held back for the GPU (gpu: steps_in_flight), and the loader threads' for a free pinned
# buffer set (buffer: summed over the threads; the GPU holding the sets)
WAITS = {
    "data": "data_wait_seconds",
    "gpu": "gpu_wait_seconds",
    "buffer": "buffer_wait_seconds",
}


class StepClock:
    """Synchronised timestamps at two steps: the timed window excludes warm-up/compilation.

    With ``busy`` processes, they start after the first step (compilation), so the warm-up
    steps already run beside them, and stop after the window. The trainer's waits (WAITS,
    ours only) are read at both ends of the window. After the window,
    ``sync_steps`` steps run in CUDA's sync debug mode (SyncSites), then ``profile_steps``
    under torch.profiler, to report how busy the GPU was (kernel time over wall time)."""

    def __init__(
        self, start: int, stop: int, profile_steps: int = 0, sync_steps: int = 0, busy: int = 0
    ):
        self.start, self.stop, self.step = start, stop, 0
        self.sync_sites = SyncSites(sync_steps) if torch.cuda.is_available() else None
        self.t0 = self.t1 = None
        self.profile_steps = profile_steps if torch.cuda.is_available() else 0
        self.prof = None
        self.gpu_busy = None
        self.table = ""
        self.busy = Busy(busy)
        self.trainer = None
        # the trainer's waits (WAITS: ours only) read at both ends of the window
        self.waits: dict[str, list[float]] = {kind: [] for kind in WAITS}
        self.sched: list[tuple[int, int] | None] = []  # the training thread's, at both ends
        # each timed step's end: host clock (s) and a CUDA event recorded there (host_lead)
        self.step_ends: list[tuple[float, object]] = []
        self.event0 = None
        self.host_lead_ms: dict | None = None

    def training_thread(self) -> dict | None:
        """How the training thread (the one launching the step's kernels) spent the window:
        the fractions of it running on a core and waiting, runnable, for one (the kernel's
        run queue; starved by other processes). None where Linux does not report it."""
        from eagle3lib.streaming_trainer import thread_shares

        if len(self.sched) != 2 or not self.t1:
            return None
        return thread_shares(*self.sched, self.t1 - self.t0)

    def waited(self, kind: str) -> float | None:
        """Seconds of the trainer's wait ``kind`` (WAITS) inside the window (ours only)."""
        ends = self.waits[kind]
        return ends[1] - ends[0] if len(ends) == 2 else None

    def __call__(self):
        self.step += 1
        if self.step == 1 and self.busy.n:
            self.busy.start()
        if self.step in (self.start, self.stop):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if self.step == self.start:
                self.t0 = time.perf_counter()
                if torch.cuda.is_available():
                    self.event0 = torch.cuda.Event(enable_timing=True)
                    self.event0.record()
            else:
                self.t1 = time.perf_counter()
                self._host_lead()
            from eagle3lib.streaming_trainer import thread_schedstat

            self.sched.append(thread_schedstat())
            if self.step == self.stop:
                self.busy.stop()
            for kind, attribute in WAITS.items():
                if hasattr(self.trainer, attribute):
                    self.waits[kind].append(getattr(self.trainer, attribute))
        elif self.event0 is not None and self.t1 is None:  # a timed step: no sync here
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.step_ends.append((time.perf_counter(), event))
        # after the timed window: first the sync-debug steps, then the profiled ones
        if self.sync_sites is not None:
            self.sync_sites.at_step(self.step - self.stop)
        after = self.stop + (self.sync_sites.steps if self.sync_sites is not None else 0)
        if self.profile_steps and self.step == after:
            self._profile_start()
        elif self.prof is not None and self.step == after + self.profile_steps:
            self._profile_stop()

    def _host_lead(self):
        """After the window's closing synchronisation: how far the GPU was behind the host at
        the end of each timed step (``host_lead``)."""
        if self.event0 is None:
            return
        host = [1000 * (t - self.t0) for t, _ in self.step_ends]
        gpu = [self.event0.elapsed_time(event) for _, event in self.step_ends]
        self.host_lead_ms = host_lead(host, gpu)

    def _profile_start(self):
        try:
            self.prof = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            self.prof.__enter__()
            self.p0 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - profiling is optional
            print(f"profiler unavailable: {exc}", flush=True)
            self.prof = None

    def _profile_stop(self):
        try:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.p0
            self.prof.__exit__(None, None, None)
            kernels = [
                e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            ]
            busy = sum(e.device_time for e in kernels) / 1e6  # microseconds -> seconds
            self.gpu_busy = round(busy / wall, 3)
            averages = self.prof.key_averages()
            self.table = "\n".join(
                averages.table(sort_by=key, row_limit=25)
                for key in ("self_cpu_time_total", "self_device_time_total")
            )
        except Exception as exc:  # noqa: BLE001
            print(f"profiler failed: {exc}", flush=True)
        self.prof = None


class SyncSites:
    """Where the training step makes the host wait for the GPU: ``steps`` steps after the timed
    window run under CUDA's sync debug mode, and each synchronising call's Python stack is
    counted (outside the window: recording the stacks takes time)."""

    def __init__(self, steps: int):
        self.steps, self.sites, self._saved = steps, {}, None

    def at_step(self, k: int) -> None:
        """``k``: steps since the timed window ended."""
        if self.steps and k == 0:
            self.start()
        elif k == self.steps:
            self.close()

    def start(self) -> None:
        import warnings

        self._saved = warnings.catch_warnings()  # restores filters and showwarning on exit
        self._saved.__enter__()
        self._show, warnings.showwarning = warnings.showwarning, self._record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def close(self) -> None:
        if self._saved is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._saved.__exit__(None, None, None)
            self._saved = None

    def _record(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        stack = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-2]
            if "warnings" not in f.filename
        ][-6:]
        key = " <- ".join(reversed(stack))
        self.sites[key] = self.sites.get(key, 0) + 1

    def report(self) -> str:
        per_step = sorted(self.sites.items(), key=lambda kv: -kv[1])
        return "\n".join(f"{n / max(self.steps, 1):5.1f}/step  {k}" for k, n in per_step)


def check_window(batches: int, steps: int, samples: int) -> None:
    """The timed window ends at step ``steps``, inside the one epoch a variant trains."""
    if batches < steps:
        raise SystemExit(
            f"bench/train.py: --steps {steps} is past the end of the epoch, which has "
            f"{batches} batches of --samples {samples}; raise --samples or lower --steps"
        )


def real_tokens_per_batch(loader, epoch: int, total_seq_len: int) -> list[int]:
    """Real tokens of each batch as CollateFn/shift_batch pack them."""
    from eagle3lib.batches import real_tokens

    batches = loader.batch_sampler._generate_batches(epoch)  # noqa: SLF001
    return real_tokens(batches, np.asarray(loader.dataset.approx_lengths), total_seq_len)


def run_variant(
    name: str, index: int, args, record, shards, manifests, vocab_map, out: Path
) -> dict:
    from speculators.train import trainer as st

    from eagle3lib import streaming_trainer, train

    v = variant(name)
    cfg = TrainConfig(
        epochs=1,
        total_seq_len=args.total_seq_len,
        draft_vocab_size=args.draft_vocab,
        num_layers=args.num_layers,
        optimizer=v.optimizer,
        lr=TrainConfig.lr * v.lr_factor,
        max_steps=args.steps + args.sync_sites + args.profile_steps + 1,
        log_every=args.log_every or v.log_every,  # --log-every: loss curves (a sync per log)
        seed=0,
        val_fraction=0.02,
        # --smoke: no worker processes (on a CPU each would import torch)
        loader_workers=0 if args.smoke else args.workers if v.workers is None else v.workers,
        loader_threads=v.loader_threads,
        packing=v.packing,
        newton_schulz=v.newton_schulz,
        graph_step=v.graph_step,  # as the train job sets it (train.train refuses where it can't)
        loss="eager" if args.eager_loss else "auto",
        fsdp=args.fsdp,
    )
    contended = name.endswith(CONTEND) or (args.contend and CONTEND not in args.variants)
    local_rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    busy = args.contend if contended and local_rank0 else 0
    clock = StepClock(args.warmup, args.steps, args.profile_steps, args.sync_sites, busy)
    tokens_box = {}

    def timed(cls):
        class TimedTrainer(cls):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                tokens_box["per_batch"] = real_tokens_per_batch(
                    self.train_loader, 0, args.total_seq_len
                )
                tokens_box["layers"] = len(getattr(self.model, "module", self.model).layers)
                check_window(len(tokens_box["per_batch"]), args.steps, args.samples)
                clock.trainer = self
                callback = graph_steps(clock) if v.cuda_graphs else clock
                self.train_epoch = functools.partial(super().train_epoch, step_callback=callback)

            def val_epoch(self, epoch):  # not part of the benchmark
                return None

        return TimedTrainer

    if v.trainer == "ours":
        base = type(
            "BenchStreamingTrainer",
            (streaming_trainer.StreamingTrainer,),
            {
                "sync_free": not v.syncs,
                "ddp_broadcast_buffers": v.broadcast_buffers,
                "ddp_gradient_as_bucket_view": v.bucket_view,
                "batched_muon": v.batched_muon,
                "muon_across_ranks": v.muon_across_ranks,
            },
        )
    else:
        base = st.Trainer
    state = out / f"state-{index}"  # a repeated variant never resumes the earlier run
    if state.exists() and os.environ.get("RANK", "0") == "0":  # other ranks wait in train()
        shutil.rmtree(state)
    started, graphs_before = time.perf_counter(), compiled_graphs()
    skips_before = compile_counter("inductor", "cudagraph_skips")
    threads = intra_op_threads(v)
    try:
        torch.set_num_threads(threads)
        with compiled_newton_schulz(v.compiled_ns), inductor_settings(v):
            stats = train.train(
                cfg,
                record,
                shards,
                manifests,
                vocab_map,
                state,
                state / "metrics.jsonl",
                trainer_class=timed(base),
            )
    finally:  # training that ended early leaves nothing switched on or running
        if clock.sync_sites is not None:
            clock.sync_sites.close()
        clock.busy.stop()
        torch.set_num_threads(TORCH_THREADS)
    (out / f"profile-{name}.txt").write_text(clock.table)
    if clock.sync_sites is not None and clock.sync_sites.steps:
        (out / f"sync-sites-{name}.txt").write_text(clock.sync_sites.report() + "\n")
        print(f"sync sites ({name}):\n{clock.sync_sites.report()}", flush=True)
    per_batch = tokens_box["per_batch"]
    tokens = sum(per_batch[args.warmup : args.steps])
    steps_timed = args.steps - args.warmup
    seconds = clock.t1 - clock.t0
    wait, gpu_wait = clock.waited("data"), clock.waited("gpu")
    processes = stats.get("processes", 1)
    if processes > 1:  # every rank trained its own batches: add them up
        import torch.distributed as dist

        both = torch.tensor(
            [float(tokens), seconds, wait or 0.0, gpu_wait or 0.0],
            device="cuda" if torch.cuda.is_available() else "cpu",
        )
        dist.all_reduce(both)
        tokens, seconds = int(both[0]), float(both[1]) / processes
        wait = float(both[2]) / processes if wait is not None else None
        gpu_wait = float(both[3]) / processes if gpu_wait is not None else None
    curve = None
    if cfg.log_every == 1 or args.log_every:
        curves = train.loss_curves(train.read_metrics(state / "metrics.jsonl"))
        curve = {"step": curves["step"], "train_loss": curves["train_loss"]}
    if os.environ.get("RANK", "0") == "0":  # its checkpoints (GBs each) would fill the disk
        shutil.rmtree(state, ignore_errors=True)
    kind = "fsdp" if args.fsdp else "ddp"
    return {
        "variant": name + (f"_{kind}{processes}" if processes > 1 else ""),
        "name": name,
        "total_seq_len": args.total_seq_len,
        "num_layers": tokens_box["layers"],  # the draft's decoder layers, as built
        "loss_curve": curve,
        "processes": processes,
        "optimizer": v.optimizer,
        "packing": v.packing,
        "contend": busy,
        "intra_op_threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "steps_timed": steps_timed,
        "real_tokens": tokens,
        # real tokens over positions in the window, every rank's batches together
        "window_fill": round(tokens / (steps_timed * processes * args.total_seq_len), 4),
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / steps_timed, 2),
        "tokens_per_s": round(tokens / seconds),
        # the training loop's wait for batches: in the timed window, and over the whole run
        "data_wait_fraction": round(wait / seconds, 4) if wait is not None else None,
        # the training loop held back for the GPU (at most steps_in_flight steps ahead)
        "gpu_wait_fraction": round(gpu_wait / seconds, 4) if gpu_wait is not None else None,
        # the loader threads' wait for a free pinned buffer set, summed over the threads (so
        # up to loader_threads x the window), over the window (this rank's)
        "buffer_wait_fraction": None
        if clock.waited("buffer") is None
        else round(clock.waited("buffer") / seconds, 4),
        # the training thread in the window: on a core, and runnable but waiting for one
        "training_thread": clock.training_thread(),
        # the GPU work queued as the host ended each timed step (ms): about a step or more,
        # the GPU set the pace; a few ms, the host launching the kernels did
        "host_lead_ms": clock.host_lead_ms,
        "run_data_wait_fraction": stats.get("data_wait_fraction") if v.trainer == "ours" else None,
        "gpu_busy_fraction": clock.gpu_busy,
        "ddp_broadcast_buffers": getattr(clock.trainer.model, "broadcast_buffers", None),
        "ddp_gradient_as_bucket_view": getattr(
            clock.trainer.model, "gradient_as_bucket_view", None
        ),
        # under DDP: whether every rank ended with the same weights (Muon split over the ranks
        # sends each its update; a lost or misread one would make them differ)
        "ranks_agree": stats["ranks_agree"],
        "graphs_compiled": compiled_graphs() - graphs_before,
        # compiled regions that ran without CUDA graphs (inductor logs each one's reason)
        "cudagraph_skips": compile_counter("inductor", "cudagraph_skips") - skips_before
        if v.cuda_graphs
        else None,
        "attention": stats["attention"],
        "loss_implementation": stats["loss_implementation"],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def intra_op_threads(v: Variant) -> int:
    """torch's intra-op threads for a run of ``v``: ours, what the train job gives each process
    (rules/train.smk asks a node for ``process_threads`` cores a GPU, and scripts/train.py holds
    torch's threads to each process's share); speculators' trainer, torch's default here (what
    its CLI gets when started as one process)."""
    return process_threads(v.loader_threads) if v.trainer == "ours" else TORCH_THREADS


@contextlib.contextmanager
def inductor_settings(v: Variant):
    """Inside the block, torch.compile's inductor with ``v``'s CUDA graphs and C++ wrapper
    settings; the compiled frames of earlier runs are dropped on the way in and out, so no run
    replays code compiled under another setting."""
    changed = {
        k: True
        for k, on in (("triton.cudagraphs", v.cuda_graphs), ("cpp_wrapper", v.cpp_wrapper))
        if on
    }
    if not changed:
        yield
        return
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(changed):
            yield
    finally:
        torch._dynamo.reset()


def graph_steps(clock):
    """``clock``, then a new CUDA graph trees iteration marked: the step's outputs (loss,
    metrics) may be overwritten from here on, and the next step's replays may reuse them."""

    def after_step():
        clock()
        torch.compiler.cudagraph_mark_step_begin()

    return after_step


@contextlib.contextmanager
def compiled_newton_schulz(on: bool, backend: str = "inductor"):
    """Inside the block (if ``on``), torch's Muon calls its Newton-Schulz function under
    torch.compile: ``_single_tensor_muon`` looks it up in its module at every call."""
    if not on:  # every other variant: torch's Muon untouched
        yield
        return
    from torch.optim import _muon

    eager = _muon._zeropower_via_newtonschulz  # noqa: SLF001
    _muon._zeropower_via_newtonschulz = torch.compile(eager, backend=backend)  # noqa: SLF001
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = eager  # noqa: SLF001


def compile_counter(group: str, name: str) -> int:
    """One of torch.compile's counters in this process so far (reporting only)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters[group][name])
    except Exception:  # noqa: BLE001 - an internal counter, reporting only
        return 0


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (a recompiling run shows)."""
    return compile_counter("stats", "unique_graphs")


def run_or_note(name: str, run, failures: list[dict]) -> dict | None:
    """``run()``'s result. An experiment's failure (``Variant.experiment``: CUDA graphs that do
    not record, a C++ wrapper that does not build) is printed and noted in ``failures``, and
    None returned, so that one call's other runs still count; any other failure is raised."""
    try:
        return run()
    except Exception as exc:
        if not variant(name).experiment:
            raise
        import traceback

        traceback.print_exc()
        failures.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(f"{name}: failed ({failures[-1]['error'][:300]}); the call goes on", flush=True)
        return None
    finally:  # a finished run's trainer (a graphed step's memory pool) is in a reference
        import gc  # cycle: free it before the next run, not during its capture

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def pairs(results: list[dict], a: str, b: str) -> list[float]:
    """Tokens/s of the i-th run of variant ``a`` over the i-th run of ``b`` (runs interleaved
    in the order given pair up)."""
    first = [r["tokens_per_s"] for r in results if r["name"] == a]
    second = [r["tokens_per_s"] for r in results if r["name"] == b]
    return [round(x / y, 3) for x, y in zip(first, second, strict=False)]


def median_of(results: list[dict], name: str, key: str = "tokens_per_s") -> float | None:
    values = [r[key] for r in results if r["name"] == name and r[key] is not None]
    return float(np.median(values)) if values else None


def summarize(results: list[dict], tag: str) -> tuple[dict, list[str]]:
    """The comparisons of one call: (summary, ``key = value`` lines).

    - ours (AdamW) against speculators' trainer at its best loader setting of this call
      (the setting with the highest median tokens/s): every pair's ratio, min and median;
      the key is the min; the same for ours_ffd (the workflow's default packing);
    - ours_muon (the workflow's default recipe with speculators' packing) and ours_muon_ffd
      (with its own) against speculators_cli (its CLI defaults); ours_muon_ffd against
      ours_muon_ffd_standard (Gram Newton-Schulz against torch's iteration; with --log-every
      the largest relative difference between their losses too);
    - ours+contend and ours_ffd+contend (busy processes in the window) against quiet ours
      and ours_ffd: medians, and per pair;
    - ours_ffd against ours (fuller batches);
    - under DDP, ours_muon_ffd (Muon split over the ranks) against ours_muon_ffd_every_rank;
    - ours_muon_ffd_cg and ours_muon_ffd_cppwrap against ours_muon_ffd: tokens/s per pair,
      and where the runs logged their losses (--log-every), the largest relative difference
      between the losses of each pair's runs (the same batches, the same kernels launched
      otherwise), and with --repeat between a variant's later runs and its first
      (``<variant>.repeat``: ours_ffd, ours_muon_ffd and their graphed steps)."""
    summary: dict = {}
    lines: list[str] = []

    def comparison(key: str | list[str], a: str, b: str) -> None:
        ratios = pairs(results, a, b)
        if not ratios:
            return
        keys = [key] if isinstance(key, str) else key
        lines.append(f"{keys[0]} per pair ({a} / {b}): " + ", ".join(f"{x:.3f}" for x in ratios))
        for k in keys:
            summary[k] = {
                "pairs": ratios,
                "min": min(ratios),
                "median": round(float(np.median(ratios)), 3),
                "against": b,
            }
            lines.append(f"train.{tag}.{k} = {min(ratios):.3f}")
            lines.append(f"train.{tag}.{k}.median = {float(np.median(ratios)):.3f}")

    def same_losses(key: str, a: str, b: str) -> None:
        from eagle3lib.train import max_relative_difference

        curves = [
            [r["loss_curve"]["train_loss"] for r in results if r["name"] == n and r["loss_curve"]]
            for n in (a, b)
        ]
        # the i-th runs of a and b, over the steps both logged
        differences = [max_relative_difference(y, x) for x, y in zip(*curves, strict=False)]
        if differences:
            summary[key]["max_loss_relative_difference"] = max(differences)
            lines.append(f"train.{tag}.{key}.max_loss_relative_difference = {max(differences):.5f}")

    def repeat_drift(name: str) -> None:
        from eagle3lib.train import max_relative_difference

        curves = [
            r["loss_curve"]["train_loss"]
            for r in results
            if r["name"] == name and r.get("loss_curve")
        ]
        if len(curves) >= 2:
            drift = max(max_relative_difference(curves[0], c) for c in curves[1:])
            summary[f"{name}.repeat"] = {"runs": len(curves), "max_loss_relative_difference": drift}
            lines.append(f"train.{tag}.{name}.repeat.max_loss_relative_difference = {drift:.5f}")

    # AdamW with each packing, and ffd's step graphed (the train job's default on one GPU
    # since 2026-12-05: graph_step.* keys beside the eager step's): its median run
    for name, keys in (
        ("ours", packing_keys("tokens_per_s", VARIANTS["ours"].packing)),
        ("ours_ffd", packing_keys("tokens_per_s", VARIANTS["ours_ffd"].packing)),
        ("ours_ffd_graph", ["graph_step.tokens_per_s"]),
    ):
        runs = sorted((r for r in results if r["name"] == name), key=lambda r: r["tokens_per_s"])
        if not runs:
            continue
        mid = runs[(len(runs) - 1) // 2]
        for k in keys:
            lines.append(f"train.{tag}.{k} = {mid['tokens_per_s']}")
        if mid["data_wait_fraction"] is not None:
            for k in keys:
                wait = k.removesuffix("tokens_per_s") + "data_wait_fraction"
                lines.append(f"train.{tag}.{wait} = {mid['data_wait_fraction']:.4f}")
    settings = {s: median_of(results, s) for s in SPECULATORS_SETTINGS}
    settings = {s: m for s, m in settings.items() if m is not None}
    if settings:
        best = max(settings, key=settings.get)
        summary["speculators_settings"] = settings
        summary["speculators_best"] = best
        lines.append(
            "speculators' trainer, median tokens/s per setting: "
            + ", ".join(f"{s} {m:,.0f}" for s, m in settings.items())
            + f" (best: {best})"
        )
        for name in ("ours", "ours_ffd"):
            comparison(packing_keys("speedup_vs_speculators", VARIANTS[name].packing), name, best)
        comparison("graph_step.speedup_vs_speculators", "ours_ffd_graph", best)
    for name in ("ours_muon", "ours_muon_ffd"):
        keys = packing_keys("muon.speedup_vs_speculators_cli", VARIANTS[name].packing)
        comparison(keys, name, "speculators_cli")
    comparison("batched_muon.speedup_vs_torch_muon", "ours_muon", "ours_muon_torch")
    comparison("gram.speedup_vs_standard", "ours_muon_ffd", "ours_muon_ffd_standard")
    # under DDP: Muon split over the ranks against every rank orthogonalising every matrix
    comparison("muon_split.speedup_vs_every_rank", "ours_muon_ffd", "ours_muon_ffd_every_rank")
    if "gram.speedup_vs_standard" in summary:  # with --log-every: how far the losses drift
        same_losses("gram.speedup_vs_standard", "ours_muon_ffd", "ours_muon_ffd_standard")
    comparison("muon.loader_1thread_vs_4threads", "ours_muon_1loader", "ours_muon")
    comparison("muon.loader_workers_vs_threads", "ours_muon_workers", "ours_muon")
    for key, graphed, eager in (
        ("graph_step.speedup", "ours_ffd_graph", "ours_ffd"),
        ("graph_step.muon.speedup", "ours_muon_ffd_graph", "ours_muon_ffd"),
    ):
        comparison(key, graphed, eager)
        if key in summary:  # with --log-every: the same training?
            same_losses(key, graphed, eager)
    comparison(
        "graph_step.muon.speedup_vs_speculators_cli", "ours_muon_ffd_graph", "speculators_cli"
    )
    # with --log-every and --repeat: how far two runs of one variant drift apart (the yardstick
    # for graph_step's losses against the eager step's)
    for name in ("ours_ffd", "ours_ffd_graph", "ours_muon_ffd", "ours_muon_ffd_graph"):
        repeat_drift(name)
    for quiet in CONTENDED:  # busy processes beside it
        contended = median_of(results, quiet + CONTEND)
        if contended is None:
            continue
        waits = [r["data_wait_fraction"] for r in results if r["name"] == quiet + CONTEND]
        prefixes = contended_prefixes(quiet)
        for prefix in prefixes:
            summary[prefix] = {"tokens_per_s": contended, "data_wait_fractions": waits}
            lines.append(f"train.{tag}.{prefix}.tokens_per_s = {contended:.0f}")
            lines.append(f"train.{tag}.{prefix}.data_wait_fraction = {max(waits):.4f} (max)")
            if median_of(results, quiet) is not None:
                vs_quiet = contended / median_of(results, quiet)
                lines.append(f"train.{tag}.{prefix}.vs_quiet = {vs_quiet:.3f}")
        keys = [f"{prefix}.vs_quiet_per_pair" for prefix in prefixes]
        comparison(keys, quiet + CONTEND, quiet)
    for name in (n for n in ("ours_1thread" + CONTEND, "ours_1thread") if median_of(results, n)):
        waits = [r["data_wait_fraction"] for r in results if r["name"] == name]
        lines.append(
            f"{name}: {median_of(results, name):,.0f} tokens/s, data wait {max(waits):.4f} (max)"
        )
    if median_of(results, "ours_ffd") is not None:
        fill = median_of(results, "ours_ffd", "window_fill")
        lines.append(f"ours_ffd window fill {fill:.3f}")
        comparison("ffd.speedup_vs_ours", "ours_ffd", "ours")
    for key, name in (
        ("cuda_graphs", "ours_muon_ffd_cg"),
        ("cpp_wrapper", "ours_muon_ffd_cppwrap"),
    ):
        comparison(f"{key}.speedup", name, "ours_muon_ffd")
        if f"{key}.speedup" in summary:
            same_losses(f"{key}.speedup", name, "ours_muon_ffd")
    skips = [r.get("cudagraph_skips") for r in results if r["name"] == "ours_muon_ffd_cg"]
    if skips:
        lines.append(f"ours_muon_ffd_cg: compiled regions without CUDA graphs per run: {skips}")
    return summary, lines


def packing_keys(key: str, packing: str) -> list[str]:
    """The keys of a figure measured with ``packing``: #16's own name (``key``) and one naming
    the packing where it is the workflow's default (train.packing), else only the latter. The
    packing joins the key's first part where that is "muon" (muon.x: muon_ffd.x), else goes
    before it (x: ffd.x)."""
    head, _, rest = key.partition(".")
    named = f"muon_{packing}.{rest}" if head == "muon" and rest else f"{packing}.{key}"
    return [key, named] if packing == TrainConfig.packing else [named]


def pack_fill_lines(fills: dict[str, float], tag: str, total_seq_len: int) -> list[str]:
    """The fill keys at the bench's pack length: ``pack_fill`` the workflow's default packing
    (train.packing), then each packing's own."""
    from eagle3lib.batches import PACKINGS

    default = fills[f"{TrainConfig.packing}.{total_seq_len}"]
    return [f"train.{tag}.pack_fill = {default:.4f}"] + [
        f"train.{tag}.{packing}.pack_fill = {fills[f'{packing}.{total_seq_len}']:.4f}"
        for packing in PACKINGS
    ]


# --same-training's runs by optimiser: speculators' trainer (the reference), ours, the mutation
SAME_TRAINING = {
    "adamw": ("speculators_w0", "ours", "ours_lr2x"),
    "muon": ("speculators_muon_w0", "ours_muon", "ours_muon_lr2x"),
}


def same_training(args, record, data: dict, vocab_map, out: Path) -> tuple[dict, list[str]]:
    """ours and speculators' trainer (no workers: the same batches, the same recipe: AdamW,
    or with --same-training-optimizer muon speculators' Muon against the train job's), and ours
    with twice the learning rate, ``--same-training`` steps with the loss logged every step:
    the largest relative difference of each from speculators' losses. Muon's keys take
    ``same_training.muon``."""
    from eagle3lib.train import SAME_TRAINING_BF16_RTOL, max_relative_difference

    n = args.same_training
    short = argparse.Namespace(
        **{**vars(args), "steps": n, "warmup": 1, "profile_steps": 0, "sync_sites": 0}
    )
    short.log_every, short.contend = 1, 0
    reference, name_ours, name_mutant = SAME_TRAINING[args.same_training_optimizer]
    curves = {}
    for k, name in enumerate((reference, name_ours, name_mutant)):
        result = run_variant(name, 1000 + k, short, record, *data["bf16"], vocab_map, out)
        curves[name] = result["loss_curve"]["train_loss"][:n]
    ref = curves[reference]
    ours = max_relative_difference(ref, curves[name_ours])
    mutant = max_relative_difference(ref, curves[name_mutant])
    summary = {
        "optimizer": args.same_training_optimizer,
        "steps": min(len(c) for c in curves.values()),
        "tolerance": SAME_TRAINING_BF16_RTOL,
        "ours_max_relative_difference": ours,
        "lr2x_max_relative_difference": mutant,
        "losses": curves,
    }
    tag = device_tag()
    key = "same_training" + (".muon" if args.same_training_optimizer == "muon" else "")
    verdict = "within" if ours <= SAME_TRAINING_BF16_RTOL else "OUTSIDE"
    seen = "breaks it" if mutant > SAME_TRAINING_BF16_RTOL else "DOES NOT break it"
    lines = [
        f"same training ({args.same_training_optimizer}): first {summary['steps']} losses, ours"
        f" vs speculators' trainer {verdict} the bf16 tolerance {SAME_TRAINING_BF16_RTOL};"
        f" twice the lr {seen}",
        f"train.{tag}.{key}.max_relative_difference = {ours:.5f}",
        f"train.{tag}.{key}.lr2x_max_relative_difference = {mutant:.5f}",
    ]
    return summary, lines


def muon_check(args, record, vocab_map) -> tuple[dict, list[str]]:
    """The train job's Muon on a GPU (``muon.gpu_optimizers`` with train.newton_schulz's
    default: BatchedMuon) against torch's Muon (speculators'), with torch's Muon iterating in
    fp32 (``precision.Fp32Muon``) as the reference, on the draft's own Muon matrices
    (speculators' split), ``--muon-check`` steps from the same weights with the same random
    gradients. For the matrices taken by Gram Newton-Schulz: the largest ratio of the train
    job's distance to the reference over torch's (tests/test_muon.py's tolerance is 0.5); for
    the others: the largest relative difference to torch's (its tolerance is 1 %); and each
    one's step time (median over the steps after the first, GPU synchronised)."""
    from speculators.train.optimizers import split_named_params_for_muon

    from eagle3lib import config, muon, train
    from eagle3lib.precision import Fp32Muon

    cfg = TrainConfig(draft_vocab_size=args.draft_vocab, num_layers=args.num_layers)
    aux = config.resolve_aux_layers(None, record["num_hidden_layers"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    draft = train.build_draft(cfg, record, aux, vocab_map, "sdpa").to(device)
    shapes = [tuple(p.shape) for _, p in split_named_params_for_muon(draft)[0]]
    del draft
    gen = torch.Generator(device=device).manual_seed(0)
    start = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen, device=device) for s in shapes]
             for _ in range(args.muon_check)]  # fmt: skip
    updates, seconds = {}, {}
    for name in ("Muon", "BatchedMuon", "Fp32Muon"):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opts = [torch.optim.Muon(params, lr=cfg.lr, weight_decay=0.01)]
        if name == "BatchedMuon":
            opts = muon.gpu_optimizers(opts, cfg.newton_schulz)
            taken = [(o, p) for o in opts if type(o) is muon.BatchedMuon
                     for g in o.param_groups for p in g["params"]]  # fmt: skip
            batched = sum(o.batched for o, _ in taken)
            by_gram = {  # the matrices the optimiser's own units take by Gram Newton-Schulz
                id(g["params"][i])
                for o in opts if type(o) is muon.BatchedMuon for g in o.param_groups
                for indices, kind in muon._units(g["params"], g["ns_steps"], gram=o.gram,
                                                 batched=o.batched)
                if kind == "gram" for i in indices
            }  # fmt: skip
            gram = [id(p) in by_gram for p in params]
        elif name == "Fp32Muon":
            opts = [Fp32Muon.like(opts[0])]
        updates[name], seconds[name] = [], []
        for step in grads:
            before = [p.detach().clone() for p in params]
            for p, g in zip(params, step, strict=True):
                p.grad = g
            sync()
            t0 = time.perf_counter()
            for opt in opts:
                opt.step()
            sync()
            seconds[name].append(time.perf_counter() - t0)
            updates[name].append([p.detach() - b for p, b in zip(params, before, strict=True)])
    worst, worst_ratio = 0.0, 0.0
    for mine, theirs, ref in zip(*(updates[k] for k in ("BatchedMuon", "Muon", "Fp32Muon")),
                                 strict=True):  # fmt: skip
        for a, b, r, g in zip(mine, theirs, ref, gram, strict=True):
            if g:
                worst_ratio = max(worst_ratio, ((a - r).norm() / (b - r).norm()).item())
            else:
                worst = max(worst, ((a - b).norm() / b.norm()).item())
    ms = {k: 1000 * float(np.median(v[1:])) for k, v in seconds.items()}
    tag = device_tag()
    summary = {"matrices": len(shapes), "batched_matrices": batched, "gram_matrices": sum(gram),
               "shapes": sorted(set(shapes)), "steps": args.muon_check,
               "newton_schulz": cfg.newton_schulz, "max_relative_difference": worst,
               "gram_worst_distance_ratio": worst_ratio, "step_ms": ms}  # fmt: skip
    lines = [
        f"muon check: {len(shapes)} matrices of {len(set(shapes))} shapes ({batched} batched, "
        f"{sum(gram)} by Gram Newton-Schulz), {args.muon_check} steps; step {ms['Muon']:.2f} ms "
        f"(torch) vs {ms['BatchedMuon']:.2f} ms (the train job's)",
        f"train.{tag}.batched_muon.max_relative_difference = {worst:.5f}",
        f"train.{tag}.gram_muon.worst_distance_ratio_to_fp32 = {worst_ratio:.3f}",
        f"train.{tag}.batched_muon.step_ms = {ms['BatchedMuon']:.2f}",
        f"train.{tag}.torch_muon.step_ms = {ms['Muon']:.2f}",
    ]
    return summary, lines


# variants that differ from another only under DDP: on one GPU they are that one
ONE_GPU_TWIN = {
    "ours_nobcast": "ours",
    "ours_muon_ffd_every_rank": "ours_muon_ffd",
    "ours_muon_ffd_bucketview": "ours_muon_ffd",
    "ours_muon_ffd_nobcast": "ours_muon_ffd",
    "ours_muon_ffd_ddpopts": "ours_muon_ffd",
}
DEFAULT_RECIPE = "ours_muon_ffd"  # the train rule's defaults: Muon, log every 10, ffd


def scaling_lines(results: list[dict], single: list[dict], processes: int, tag: str) -> list[str]:
    """Each variant's median tokens/s under DDP against ``processes`` times its median in the
    one-GPU run ``single`` (bench_train.json's results), or its ``ONE_GPU_TWIN``'s there
    where the one-GPU run lacks it. Keys name the variant (``ours``, AdamW with speculators'
    multipack: multipack); #16's unprefixed scaling_efficiency is DEFAULT_RECIPE's."""
    one_gpu = {r.get("name", r.get("variant")) for r in single}
    lines = []
    for name in dict.fromkeys(r["name"] for r in results):
        base = name if name in one_gpu else ONE_GPU_TWIN.get(name)
        if base not in one_gpu:
            lines.append(f"no scaling efficiency for {name}: --baseline has no one-GPU run of it")
            continue
        one = float(np.median([r["tokens_per_s"] for r in single
                               if r.get("name", r.get("variant")) == base]))  # fmt: skip
        mine = median_of(results, name)
        efficiency = f"{mine / (processes * one):.3f}"
        key = ".multipack" if name == "ours" else f".{name.removeprefix('ours_')}"
        if name not in ("ours", "ours_ffd"):  # those runs' tokens/s: ``summarize``'s keys
            lines.append(f"train.{tag}{key}.tokens_per_s = {mine:.0f}")
        lines.append(f"train.{tag}{key}.scaling_efficiency = {efficiency}")
        if name == DEFAULT_RECIPE:  # #16's key: the train rule's own recipe
            lines.append(f"train.{tag}.scaling_efficiency = {efficiency}")
    return lines


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command line's settings (defaults filled in) and the variant names to run, in
    order; an unknown variant stops with the list of known ones."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--variants", default="ours,speculators_fastest,speculators_cli,ours_workers")
    p.add_argument(
        "--repeat", type=int, default=1, help="run the variants, in order, this many times"
    )
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--total-seq-len", type=int, default=None)
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=1, help="the draft's decoder layers")
    p.add_argument("--workers", type=int, default=12, help="workers of *_fastest, ours_workers")
    p.add_argument("--profile-steps", type=int, default=5, help="steps profiled after the window")
    p.add_argument(
        "--sync-sites",
        type=int,
        default=0,
        help="steps after the timed ones run in CUDA sync debug mode; lists where the host waits",
    )
    p.add_argument(
        "--contend",
        type=int,
        default=0,
        help="busy processes during the timed window of the variants written name+contend "
        "(of every variant if none is)",
    )
    p.add_argument(
        "--same-training",
        type=int,
        default=0,
        metavar="STEPS",
        help="also train ours, speculators' trainer and ours with twice the lr for STEPS steps "
        "on the same batches, loss logged every step, and compare the losses",
    )
    p.add_argument(
        "--same-training-optimizer",
        choices=tuple(SAME_TRAINING),
        default="adamw",
        help="--same-training's recipe: AdamW, or Muon (speculators' against the train job's)",
    )
    p.add_argument(
        "--baseline", default=None, help="bench_train.json of a 1-GPU run (DDP efficiency)"
    )
    p.add_argument(
        "--eager-loss",
        action="store_true",
        help="train.loss eager (auto too since 2026-12-05; before, fused on torch >= 2.13)",
    )
    p.add_argument("--fsdp", action="store_true", help="shard the draft over the ranks (FSDP2)")
    p.add_argument(
        "--log-every", type=int, default=None, help="log the loss every N steps (loss curves)"
    )
    p.add_argument(
        "--shape",
        choices=["llama-8b", "smollm2"],
        default="llama-8b",
        help="verifier shape; smollm2: the quality preset's (sample lengths 256-1024, packs of "
        "8192 unless --total-seq-len)",
    )
    p.add_argument(
        "--muon-check",
        type=int,
        default=0,
        help="N steps of BatchedMuon against torch's Muon on the draft's matrices (update "
        "difference and optimiser step time)",
    )
    p.add_argument("--out", default=os.environ.get("BENCH_DIR", "/tmp/eagle3-bench-train"))
    args = p.parse_args(argv)
    smoke = args.smoke
    args.samples = args.samples or (48 if smoke else 400)
    args.steps = args.steps or (12 if smoke else 60)
    args.warmup = args.warmup or (3 if smoke else 10)
    small = args.shape == "smollm2"
    args.total_seq_len = args.total_seq_len or (256 if smoke else 8192 if small else 2048)
    args.draft_vocab = args.draft_vocab or (128 if smoke else 32000)
    names = [n for n in args.variants.split(",") if n] * args.repeat
    if unknown := sorted({n.removesuffix(CONTEND) for n in names} - set(VARIANTS)):
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    return args, names


def main() -> None:
    args, names = parse_args()
    smoke = args.smoke
    small = args.shape == "smollm2"

    from eagle3lib import batches, vocab
    from eagle3lib.verifier import allow_recompiles, materialize

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if smoke else SMOLLM2 if small else LLAMA_8B

    def prepare():
        """The bench's verifier folder and shards, written where missing, and its vocab map."""
        verifier = make_verifier(out / "verifier", shape)
        record = materialize(str(verifier), "bench-verifier", out / "unused")
        rng = np.random.default_rng(0)
        low, high = (32, 200) if smoke else (256, 1024) if small else (256, 2048)
        lengths = [int(x) for x in rng.integers(low, high + 1, args.samples)]
        data = {"bf16": make_shards(out, record, lengths, 4, seed=0)}
        if any(variant(n).storage == "fp8" for n in names):
            (out / "fp8").mkdir(exist_ok=True)
            data["fp8"] = make_shards(out / "fp8", record, lengths, 4, seed=0, storage="fp8")
        v = shape["vocab_size"]
        d2t, t2d = vocab.build(
            np.bincount(rng.integers(0, v, 200000), minlength=v), args.draft_vocab
        )
        return record, lengths, data, {"d2t": d2t, "t2d": t2d}

    from eagle3lib import distributed

    # under torchrun every rank trains on the same files: rank 0 writes them while the others
    # wait, then they read them (two ranks writing the same shard at once corrupt it)
    first = distributed.setup_distributed() == 0
    prepared = prepare() if first else None
    distributed.barrier()
    record, lengths, data, vocab_map = prepared or prepare()

    allow_recompiles(1024)  # every run builds a new draft: never fall back to eager
    results: list[dict] = []
    failures: list[dict] = []
    partial = out / f"bench_train.partial-{os.environ.get('RANK', '0')}.json"

    with distributed.torn_down():
        for index, name in enumerate(names):
            shards = data[variant(name).storage]
            run = functools.partial(run_variant, name, index, args, record, *shards, vocab_map, out)
            result = run_or_note(name, run, failures)
            if result is None:
                continue
            results.append(result)
            print(json.dumps(results[-1]), flush=True)
            partial.write_text(json.dumps(results, indent=2))  # what a timed-out call keeps
        same = None
        checked = muon_check(args, record, vocab_map) if args.muon_check else None
        if args.same_training:
            same = same_training(args, record, data, vocab_map, out)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    processes = results[0]["processes"] if results else 1
    tag = device_tag(processes) + (".fsdp" if args.fsdp and processes > 1 else "")
    summary, lines = summarize(results, tag)
    # packing fill of the bench's length mix (the training samples), per sampler and length
    fills = {
        f"{packing}.{n}": round(batches.pack_fill(packing, lengths, n, processes), 4)
        for packing in batches.PACKINGS
        for n in sorted({2048, 8192, args.total_seq_len})
    }
    summary["pack_fill"] = fills
    lines.append("pack fill (real tokens / positions, one epoch of the bench's samples): ")
    lines[-1] += ", ".join(f"{k} {v:.3f}" for k, v in fills.items())
    lines += pack_fill_lines(fills, tag, args.total_seq_len)
    if same is not None:
        summary["same_training"] = same[0]
        lines += same[1]
    if checked is not None:
        summary["muon_check"] = checked[0]
        lines += checked[1]
    fp8 = pairs(results, "ours_fp8", "ours")
    if fp8:  # the same states from fp8 shards (dequantized on the GPU) against bf16 shards
        lines.append("fp8 / bf16 per pair: " + ", ".join(f"{x:.3f}" for x in fp8))
        lines.append(f"train.{tag}.fp8_vs_bf16_tokens_per_s = {float(np.median(fp8)):.3f}")
    if args.baseline and processes > 1:
        single = json.loads(Path(args.baseline).read_text())["results"]
        lines += scaling_lines(results, single, processes, tag)
    wall = round(time.perf_counter() - t_start)
    summary.update(
        {
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "wall_s": wall,
            "results": results,
            "failed": failures,
        }
    )
    lines += [f"failed: {f['name']}: {f['error'][:300]}" for f in failures]
    lines += [f"ranks disagree: {r['variant']} ended with different weights on its ranks"
              for r in results if r.get("ranks_agree") is False]  # fmt: skip
    kind = "fsdp" if args.fsdp else "ddp"
    name = "bench_train" + (f"_{kind}{processes}" if processes > 1 else "")
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{'variant':26s} {'optimizer':9s} {'ms/step':>8s} {'tokens/s':>9s} {'fill':>6s}"
        f" {'data wait':>9s} {'gpu wait':>9s} {'buf wait':>9s} {'rq wait':>8s} {'lead ms':>8s}"
        f" {'wall s':>7s}"
    )
    for r in results:
        wait = "-" if r["data_wait_fraction"] is None else f"{r['data_wait_fraction']:.4f}"
        # absent from runs of earlier code
        held, buffers = (r.get(k) for k in ("gpu_wait_fraction", "buffer_wait_fraction"))
        held = "-" if held is None else f"{held:.4f}"
        buffers = "-" if buffers is None else f"{buffers:.4f}"
        thread = r.get("training_thread")  # absent from runs of earlier code (--baseline)
        queued = "-" if not thread else f"{thread['runqueue_wait_fraction']:.4f}"
        lead = r.get("host_lead_ms") or {}
        lead = f"{lead['median']:.1f}" if lead.get("steps") else "-"
        print(
            f"{r['variant']:26s} {r['optimizer']:9s} {r['ms_per_step']:8.1f}"
            f" {r['tokens_per_s']:9d} {r['window_fill']:6.3f} {wait:>9s} {held:>9s}"
            f" {buffers:>9s} {queued:>8s} {lead:>8s} {r['wall_s']:7.1f}"
        )
    print("\n".join(lines))
    print(f"bench wall time: {wall} s")


if __name__ == "__main__":
    main()
