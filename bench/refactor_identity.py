"""Build the tiny pipeline's artifacts into a folder and print the sha256 of every file as JSON.

    python bench/refactor_identity.py /tmp/before    # at one commit
    python bench/refactor_identity.py /tmp/after     # at another
    diff <(python -m json.tool /tmp/before/hashes.json) <(python -m json.tool /tmp/after/hashes.json)

A refactor that must not change behaviour is checked by running this at both commits: the
tests' tiny random verifier (tests/tiny.py), prepared samples, two shards stored in bf16 and
two in fp8, a vocab map, two epochs of training on the bf16 shards and two on the fp8 shards
(one thread, CPU), their training state and the exported checkpoints. Every artifact must be
byte-identical (the metrics logs apart from their timings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def metrics_sha256(path: Path) -> str:
    """sha256 of a metrics log without its "profile" entries (wall-clock speeds, which differ
    from run to run): the losses, accuracies, learning rates and steps."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [{k: v for k, v in r.items() if k != "profile"} for r in records]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def artifact_hashes(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out`` by relative path (metrics logs without timings)."""
    return {
        str(p.relative_to(out)): metrics_sha256(p) if p.suffix == ".jsonl" else sha256(p)
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "hashes.json"
    }


def extract(samples, ids, record, storage: str, out: Path) -> tuple[list[Path], list[Path]]:
    from eagle3lib import hidden_states
    from eagle3lib.config import ExtractConfig

    cfg = ExtractConfig(shards=2, batch_tokens=512, storage=storage)
    shards, manifests = [], []
    for i in range(2):
        shards.append(out / f"shard-{storage}-{i}.safetensors")
        manifests.append(out / f"shard-{storage}-{i}.json")
        hidden_states.extract_shard(samples, ids, i, cfg, record, shards[-1], manifests[-1])
    return shards, manifests


def train_and_export(cfg, record, shards, manifests, vocab_map, out: Path, name: str) -> None:
    from eagle3lib import checkpoint, train

    state = out / f"state-{name}"
    stats = train.train(cfg, record, shards, manifests, vocab_map, state, state / "m.jsonl")
    checkpoint.export(Path(stats["final_epoch_dir"]), out / f"checkpoint-{name}", record["name"])


def build(out: Path) -> dict[str, str]:
    """Every artifact of the tiny pipeline in ``out``; their sha256 by relative path."""
    import tiny
    import torch
    from transformers import AutoTokenizer

    from eagle3lib import data, vocab
    from eagle3lib.config import PrepareConfig, TrainConfig
    from eagle3lib.verifier import materialize

    torch.set_num_threads(1)
    verifier = tiny.build_verifier(out / "work" / "tiny-llama")
    record = materialize(str(verifier), "tiny-llama", out / "work" / "hf")
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    path = tiny.write_jsonl(out / "work" / "train.jsonl", tiny.conversations(40, seed=5))
    prepared = data.prepare_samples(tokenizer, path, PrepareConfig(max_length=128))
    data.save_prepared(prepared, out / "samples.safetensors", record["vocab_size"])
    samples = data.load_samples(out / "samples.safetensors")
    d2t, t2d = vocab.build(samples.token_freq, 256)
    vocab.save(out / "vocab_map.safetensors", d2t, t2d)
    vocab_map = {"d2t": d2t, "t2d": t2d}
    cfg = TrainConfig(
        epochs=2, total_seq_len=256, draft_vocab_size=256, optimizer="adamw", lr=3e-3, seed=0
    )
    bf16 = extract(samples, prepared.ids, record, "bf16", out)
    fp8 = extract(samples, prepared.ids, record, "fp8", out)
    train_and_export(cfg, record, *bf16, vocab_map, out, "bf16")
    train_and_export(cfg, record, *fp8, vocab_map, out, "fp8")
    return {k: v for k, v in artifact_hashes(out).items() if not k.startswith("work/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="empty or new folder for the artifacts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hashes = build(args.out)
    (args.out / "hashes.json").write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    print(json.dumps(hashes, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
