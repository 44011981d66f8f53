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
from eagle3lib.lifetime import hold_folders


def arguments() -> argparse.Namespace:
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
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    return p.parse_args()


@cli
def main() -> None:
    a = arguments()
    hold_folders("serve_check", a.out, a.provenance)

    from transformers import AutoTokenizer

    from eagle3lib import data, serve
    from eagle3lib.conversations import read_eval_prompts
    from eagle3lib.verifier import read_record

    record = read_record(a.verifier)
    evaluate = json.loads(a.evaluate)
    engine = json.loads(a.vllm)
    import torch

    engine["dtype"] = serve.compute_dtype(
        engine.get("dtype"), evaluate.get("dtype", "auto"), torch.cuda.is_available()
    )
    if not torch.cuda.is_available():  # vLLM on this CPU: no bf16 where it is slow
        from eagle3lib.hidden_states import resolve_dtype

        resolve_dtype(engine["dtype"], torch.device("cpu"), "vllm.dtype")
    tokenizer = AutoTokenizer.from_pretrained(
        record["load_path"], trust_remote_code=record["trust_remote_code"]
    )
    prompts = read_eval_prompts(a.prompts, a.max_prompts or None)
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
    # The command as run from the run folder (reports/ is one of its folders): it stays true
    # for a copied or renamed run folder.
    run_dir = a.out.parent.parent
    result["serve_command"] = serve.serve_command(
        serve.from_folder(record["load_path"], run_dir),
        serve.from_folder(checkpoint, run_dir),
        result["k"],
        record["trust_remote_code"],
        # the KV cache serve_check's server had (serve.serve_check: vllm.cpu_kvcache_gib)
        serve.engine_env(engine.get("cpu_kvcache_gib", 1))["VLLM_CPU_KVCACHE_SPACE"]
        if serve.on_cpu()
        else None,
    )
    write_json(a.out, result)
    print(json.dumps(result, indent=2))
    print(f"serve the draft from {run_dir} with:\n  {result['serve_command']}")
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(
            a.provenance, "serve_check", {**evaluate, **engine}, a.verifier, None, stamp=a.stamp
        )


if __name__ == "__main__":
    main()
