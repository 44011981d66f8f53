"""Train the EAGLE-3 draft with speculators and export the checkpoint (+ model card).

With --gpus N > 1 it relaunches itself under torchrun (DDP, one process per leased GPU); with
--nodes N > 1 (started once per node by the GPU wrapper's srun step) under a multi-node torchrun
that meets the other nodes in a c10d rendezvous (eagle3lib/multinode.py).
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.config import TrainConfig, from_json
from eagle3lib.errors import cli
from eagle3lib.fileio import atomic_path, hash_ahead, write_json
from eagle3lib.lifetime import Phases, hold_folders
from eagle3lib.multinode import per_node, relaunch
from eagle3lib.verifier import read_record


def parse():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--shards", type=Path, nargs="+", required=True)
    p.add_argument("--manifests", type=Path, nargs="+", required=True)
    p.add_argument("--vocab-map", type=Path, required=True)
    p.add_argument("--train", required=True, help="the config's train section as JSON")
    p.add_argument("--state-dir", type=Path, required=True, help="resumable trainer state")
    p.add_argument("--gpus", type=int, default=0, help="GPUs leased for this job")
    p.add_argument("--processes", type=int, default=None, help="DDP processes (default: --gpus)")
    p.add_argument("--nodes", type=int, default=1, help="train.nodes (processes are per node)")
    p.add_argument("--node-gpus", type=int, default=0, help="with --nodes > 1: GPUs per node")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--loader-threads", type=int, default=None, help="train.loader_threads")
    p.add_argument("--loader-workers", type=int, default=None, help="train.loader_workers")
    p.add_argument("--keep-states", type=int, default=None, help="train.keep_states")
    p.add_argument("--out-config", type=Path, required=True)
    p.add_argument("--out-weights", type=Path, required=True)
    p.add_argument("--out-card", type=Path, required=True)
    p.add_argument("--out-summary", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    return p.parse_args()


@cli
def main() -> None:
    a = parse()
    processes = a.processes if a.processes is not None else per_node(a.nodes, a.gpus, a.node_gpus)
    lock, torchrun = relaunch(a.nodes, processes, [__file__, *sys.argv[1:]], os.environ)
    if lock:
        hold_folders("train", a.out_config, a.out_weights, a.out_card, a.out_summary, a.provenance)
    if torchrun:
        os.execv(torchrun[0], torchrun)
    # this process's timeline (torchrun's workers each are a process of their own), logged by
    # the first
    first = os.environ.get("RANK", "0") == "0"
    phases = Phases("train", echo=first)
    phases.mark("started")
    # the first process hashes the shards for their check (train_data.open_verified_shards):
    # begun now, beside the imports
    if first:
        hash_ahead(a.shards)

    import torch

    from eagle3lib import checkpoint, distributed, train, vocab

    phases.mark("imported")

    cfg = from_json(TrainConfig, a.train)
    if a.loader_workers is not None:
        cfg = dataclasses.replace(cfg, loader_workers=a.loader_workers)
    if a.threads:  # a process's share, less its DataLoader workers' cores
        share = a.threads // max(processes, 1)
        torch.set_num_threads(max(1, share - cfg.loader_workers))
    cfg = train.with_loader_threads(cfg, a.loader_threads, a.threads, processes)
    if a.keep_states is not None:
        cfg = dataclasses.replace(cfg, keep_states=a.keep_states)
    record = read_record(a.verifier)
    metrics = a.state_dir / "metrics.jsonl"
    with distributed.torn_down():
        stats = train.train(
            cfg, record, a.shards, a.manifests, vocab.load(a.vocab_map), a.state_dir, metrics,
            phases=phases,
        )  # fmt: skip
    if stats["rank"] != 0:
        return
    out_dir = a.out_config.parent
    assert a.out_weights.parent == out_dir, "config and weights must share the checkpoint folder"
    config = checkpoint.export(Path(stats["final_epoch_dir"]), out_dir, record["name"])
    stats["epochs"] = cfg.epochs
    if cfg.max_steps is not None:
        stats["max_steps"] = cfg.max_steps
    phases.mark("checkpoint exported")
    with atomic_path(a.out_card) as tmp:
        tmp.write_text(checkpoint.model_card(config, record, stats), encoding="utf-8")
    phases.mark("model card written")
    stats["timeline"] = phases.marks  # seconds since the process started
    # relative to the summary's folder: true for a copied or renamed run folder
    stats["final_epoch_dir"] = os.path.relpath(stats["final_epoch_dir"], a.out_summary.parent)
    summary = {**stats, "curves": train.loss_curves(train.read_metrics(metrics))}
    write_json(a.out_summary, summary)
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(
            a.provenance, "train", json.loads(a.train), a.verifier, cfg.seed, stamp=a.stamp
        )
    print(json.dumps({k: v for k, v in summary.items() if k != "curves"}, indent=2))


if __name__ == "__main__":
    main()
