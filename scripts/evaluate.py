"""Offline acceptance of the draft on held-out prompts (greedy chain, HF verifier)."""

import argparse
import json
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.config import EvaluateConfig, from_json
from eagle3lib.errors import cli
from eagle3lib.fileio import read_json, write_json
from eagle3lib.lifetime import hold_folders
from eagle3lib.verifier import read_record


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True, help="the checkpoint's config.json")
    p.add_argument("--manifest", type=Path, required=True, help="a shard manifest (layer ids)")
    p.add_argument(
        "--eval-sets", required=True, help="JSON [{name, path, max_prompts}], headline first"
    )
    p.add_argument("--evaluate", required=True, help="the config's evaluate section as JSON")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--provenance", type=Path, help="write provenance-<job>.json here")
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    return p.parse_args()


@cli
def main() -> None:
    a = arguments()
    hold_folders("evaluate", a.out, a.provenance)

    import torch

    from eagle3lib import checkpoint, data, evaluate, verifier
    from eagle3lib.conversations import read_eval_prompts
    from eagle3lib.hidden_states import resolve_dtype

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = from_json(EvaluateConfig, a.evaluate)
    record = read_record(a.verifier)
    aux = read_json(a.manifest)["layer_ids"][:-1]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(cfg.dtype, device, "evaluate.dtype")
    tokenizer = verifier.load_tokenizer(record)
    eval_sets = json.loads(a.eval_sets)
    for eval_set in eval_sets:
        eval_set["prompts"] = read_eval_prompts(Path(eval_set["path"]), eval_set["max_prompts"])
        for prompt in eval_set["prompts"]:
            prompt["token_ids"] = data.prompt_token_ids(tokenizer, prompt["text"])
    evaluate.check_prompt_lengths(eval_sets, record.get("max_position_embeddings"), cfg)
    model = verifier.load_model(record, dtype, device_map=verifier.device_map_for_job())
    draft = checkpoint.load_draft(a.config.parent, record, "sdpa", dtype).to(device)
    result = evaluate.evaluate(
        model,
        draft,
        tokenizer,
        eval_sets,
        cfg,
        aux,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    result["device"] = device.type
    result["dtype"] = str(dtype).removeprefix("torch.")
    write_json(a.out, result)
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(
            a.provenance,
            "evaluate",
            {**json.loads(a.evaluate), "eval_sets": json.loads(a.eval_sets)},
            a.verifier,
            None,
            stamp=a.stamp,
        )
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=2))


if __name__ == "__main__":
    main()
