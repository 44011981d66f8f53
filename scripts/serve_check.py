"""Serve the verifier with the trained draft in vLLM; acceptance from vLLM's /metrics.

Runs in the vLLM environment (config key vllm.python). Writes reports/vllm_acceptance.json and
prints the `vllm serve` command.
"""

import argparse
import json
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.config import EvaluateConfig, from_dict
from eagle3lib.errors import cli
from eagle3lib.fileio import write_json


@cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True, help="verifier.json")
    p.add_argument("--config", type=Path, required=True, help="the checkpoint's config.json")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--max-prompts", type=int, default=0, help="0 = all")
    p.add_argument(
        "--evaluate", required=True, help="the config's evaluate section (k, max_new_tokens, dtype)"
    )
    p.add_argument("--vllm", required=True, help="the config's vllm section as JSON")
    p.add_argument("--vllm-python", required=True, help="interpreter of the vLLM environment")
    p.add_argument("--server-log", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--provenance", type=Path)
    a = p.parse_args()

    from transformers import AutoTokenizer

    from eagle3lib import data, serve
    from eagle3lib.fileio import read_json

    record = read_json(a.verifier)
    evaluate = json.loads(a.evaluate)
    engine = json.loads(a.vllm)
    import torch

    engine["dtype"] = serve.compute_dtype(
        engine.get("dtype"), evaluate.get("dtype", "auto"), torch.cuda.is_available()
    )
    tokenizer = AutoTokenizer.from_pretrained(
        record["load_path"], trust_remote_code=record["trust_remote_code"]
    )
    prompts = data.read_eval_prompts(a.prompts, a.max_prompts or None)
    for prompt in prompts:
        prompt["token_ids"] = data.prompt_token_ids(tokenizer, prompt["text"])
    checkpoint = str(a.config.parent)
    result = serve.serve_check(
        a.vllm_python,
        record["load_path"],
        checkpoint,
        prompts,
        from_dict(EvaluateConfig, evaluate).k_values[0],
        evaluate["max_new_tokens"],
        engine,
        a.server_log,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        trust_remote_code=record["trust_remote_code"],
    )
    import vllm

    result["vllm_version"] = vllm.__version__
    write_json(a.out, result)
    print(json.dumps(result, indent=2))
    print(f"serve the draft with:\n  {result['serve_command']}")
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(a.provenance, "serve_check", {**evaluate, **engine}, a.verifier, None)


if __name__ == "__main__":
    main()
