"""Building the train job's draft (``train.build_draft``) on the CPU, as speculators' CLI does,
against on the GPU, as the train job does since 2026-12-06: seconds, and what the two drafts
share.

    bench/gpu_setup.sh pack                           # here: wheels and tokenizer -> .xfer/
    eval "$(bench/gpu_setup.sh install)"              # on the GPU machine
    python3 bench/draft_build.py --rounds 2           # Llama-3.1-8B shape, 8 decoder layers
    python bench/draft_build.py --smoke               # CPU, tiny shape: checks this script

It writes a verifier of the Llama-3.1-8B shape with random bf16 weights (``--layers`` decoder
layers: the draft reads only the embeddings, final norm and LM head, and its aux layers), then
builds the default one-layer draft (32,000 draft tokens) on each device in turn, ``--rounds``
times, interleaved. The verifier's tensors the draft holds must be equal on both devices, the
drafts' own random parameters the same shapes with a standard deviation within 2 % (other
draws: a GPU's generator is not the CPU's). Prints a table and `key = value` lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import extract as bench_extract  # noqa: E402
import workflow_gpu  # noqa: E402

# the tensors the draft takes from the verifier (and its vocabulary maps)
FROM_VERIFIER = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                 "verifier_norm.weight", "t2d", "d2t")  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=8, help="the verifier's decoder layers")
    p.add_argument("--work", type=Path, default=Path("/tmp/draft_build"))
    p.add_argument("--xfer", type=Path, default=ROOT / ".xfer", help="gpu_setup.sh pack's folder")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU only")
    return p.parse_args(argv)


def compare(cpu, gpu) -> dict:
    """What the two drafts share: equal verifier tensors; the random ones' std ratio."""
    a = {k: v.float().cpu() for k, v in cpu.state_dict().items()}
    b = {k: v.float().cpu() for k, v in gpu.state_dict().items()}
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    equal = {k: bool(a[k].equal(b[k])) for k in FROM_VERIFIER if k in a}
    ratios = {
        k: round(float(b[k].std() / a[k].std()), 4)
        for k in a
        if k not in FROM_VERIFIER and a[k].numel() > 1 and float(a[k].std()) > 0
    }
    return {"equal_from_verifier": equal, "random_std_ratio": ratios}


def main(argv=None) -> None:
    a = parse(argv)
    import numpy as np
    import torch

    from eagle3lib import config, train, vocab
    from eagle3lib.config import TrainConfig
    from eagle3lib.verifier import materialize

    gpu = torch.cuda.is_available() and not a.smoke
    shape = dict(bench_extract.TINY, vocab_size=49152) if a.smoke else bench_extract.LLAMA_8B
    shape = dict(shape, num_hidden_layers=min(a.layers, shape["num_hidden_layers"]))
    folder = a.work / "verifier"
    built = workflow_gpu.build_verifier(folder, shape, a.xfer / "tokenizer")
    record = materialize(str(folder), "random-llama-shape", a.work / "hf", trust_remote_code=False,
                         allow_pickle=False)  # fmt: skip
    draft_vocab = 512 if a.smoke else 32000
    cfg = TrainConfig(draft_vocab_size=draft_vocab)
    aux = config.resolve_aux_layers(None, record["num_hidden_layers"])
    # the vocab stage's own map, from counts that take every third token id
    d2t, t2d = vocab.build((np.arange(shape["vocab_size"]) % 3 == 0).astype(np.int64), draft_vocab)
    maps = {"d2t": d2t, "t2d": t2d}
    devices = [None, torch.device("cuda", 0)] if gpu else [None]
    seconds: dict[str, list[float]] = {"cpu": [], "gpu": []}
    last = {}
    for _ in range(a.rounds):
        for device in devices:
            name = "gpu" if device is not None else "cpu"
            last.pop(name, None)
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.manual_seed(0)
            last[name] = train.build_draft(cfg, record, aux, maps, "sdpa", device)
            if gpu:
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
            print(f"{name}: built in {seconds[name][-1]:.2f} s", flush=True)
    checks = compare(last["cpu"], last["gpu"]) if gpu else {}
    if checks:
        assert all(checks["equal_from_verifier"].values()), checks
        assert all(abs(r - 1) <= 0.02 for r in checks["random_std_ratio"].values()), checks
    tag = bench_extract.device_tag(1) if gpu else "cpu"
    print("\n| device | seconds (each round) | median |\n|---|---|---|")
    for name, values in seconds.items():
        if values:
            rounds = ", ".join(f"{v:.2f}" for v in values)
            print(f"| {name} | {rounds} | {statistics.median(values):.2f} |")
    print(json.dumps({"verifier": built, "checks": checks}, indent=1))
    for name, values in seconds.items():
        if values:
            print(f"draft_build.{tag}.{name}_seconds = {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
