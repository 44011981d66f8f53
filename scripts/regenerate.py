"""Regenerate the assistant turns of the training conversations with the verifier."""

import argparse
import json
import sys
from pathlib import Path

import _bootstrap  # noqa: F401
from eagle3lib.errors import UserError, cli
from eagle3lib.fileio import write_json
from eagle3lib.lifetime import hold_folders


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--verifier", type=Path, required=True, help="verifier.json")
    p.add_argument(
        "--train",
        type=Path,
        nargs="+",
        required=True,
        help="the original conversations: data.train's file, then data.extra_train's",
    )
    p.add_argument("--data", required=True, help="the config's data section as JSON")
    p.add_argument("--regenerate", required=True, help="the config's regenerate section as JSON")
    p.add_argument("--vllm", required=True, help="the config's vllm section as JSON")
    p.add_argument("--vllm-python", required=True, help="interpreter of the vLLM environment")
    p.add_argument("--work-dir", type=Path, required=True, help="finished chunks (resume)")
    p.add_argument("--server-log", type=Path, required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--out-info", type=Path, required=True)
    p.add_argument("--provenance", type=Path)
    p.add_argument("--stamp", help="what made the artifacts (JSON, from the rule)")
    p.add_argument("--workers", type=int, default=1, help="data-parallel generate processes")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # i/n: one of --workers
    return p.parse_args()


@cli
def main() -> None:
    a = arguments()
    if a.worker is None:  # its workers write chunks of the job that holds the lock
        hold_folders("regenerate", a.out, a.out_info, a.provenance)

    from eagle3lib import regenerate as rg
    from eagle3lib.config import RegenerateConfig, from_dict
    from eagle3lib.conversations import train_sources
    from eagle3lib.data import check_chat_template, render_ids_batch
    from eagle3lib.fileio import sha256_json
    from eagle3lib.verifier import load_tokenizer, read_record

    data = json.loads(a.data)
    section = json.loads(a.regenerate)
    cfg = from_dict(RegenerateConfig, section)
    if cfg.synthetic_prompts and (a.workers > 1 or a.worker):
        raise UserError(
            "config key regenerate.synthetic_prompts: prompts are sampled once, by one "
            f"process, not by {a.workers} workers; set regenerate.workers: 1"
        )
    record = read_record(a.verifier)
    tokenizer = load_tokenizer(record)
    check_chat_template(tokenizer, f"verifier {record['path']!r}")
    sources = train_sources(a.train, data)
    conversations = rg.read_sources(
        sources,
        data.get("on_invalid_record", "error"),
        data["train"].get("dedupe", False),
        log=rg.log_stderr,
    )

    def render(histories):
        return render_ids_batch(tokenizer, histories, add_generation_prompt=True)

    def decode(ids):
        return rg.answer_text(tokenizer, ids)

    fingerprint = {"regenerate": section, "verifier": record["config_sha256"], "weights": record["weights"]["sha256"],
                   "data": data["train"], "max_length": data["max_length"],
                   **({"extra_train": data["extra_train"]} if data.get("extra_train") else {}),
                   # what the files held: chunks of an edited file's conversations are redone
                   "conversations": sha256_json(conversations)}  # fmt: skip
    worker = tuple(int(x) for x in a.worker.split("/")) if a.worker else None
    run = lambda generate, make_sampler=None: rg.regenerate(  # noqa: E731
        conversations, generate, render, decode, cfg, data["max_length"], a.work_dir, fingerprint, a.out,
        log=rg.log_stderr, worker=worker,
        synthesize=make_sampler and rg.synthesizer(make_sampler, tokenizer, cfg, rg.log_stderr),
    )  # fmt: skip
    if cfg.backend == "hf" and a.workers > 1 and worker is None:
        stats = with_workers(a, cfg, fingerprint, run)
    elif cfg.backend == "vllm":
        stats = with_vllm(a, cfg, json.loads(a.vllm), record, run)
    else:
        stats = with_hf(a, cfg, record, tokenizer, run)
        if worker is not None:
            return
    info = {**stats, "settings": section, "verifier": record["name"], "source": a.train[0].name}
    if len(sources) > 1:  # the conversations of each file
        extras = [sum(c["id"].startswith(s.id_prefix) for c in conversations) for s in sources[1:]]
        counts = [len(conversations) - sum(extras), *extras]
        info["source"] = [{"path": s.path.name, "conversations": n}
                          for s, n in zip(sources, counts, strict=True)]  # fmt: skip
    write_json(a.out_info, info)
    print(json.dumps(info, indent=2), file=sys.stdout)
    if a.provenance:
        from eagle3lib import provenance

        provenance.write(a.provenance, "regenerate", section, a.verifier, cfg.seed, stamp=a.stamp)


def with_workers(a, cfg, fingerprint, run) -> dict:
    """--workers processes of this script (one per GPU) do the chunks; then the output."""
    import os
    import time

    from eagle3lib import regenerate as rg
    from eagle3lib.fileio import fingerprinted_dir

    t0 = time.perf_counter()
    _, dtype = answer_device_dtype(cfg)  # what each worker answers in (refused here first)
    fingerprinted_dir(a.work_dir, fingerprint)  # before the workers share it
    done_before = len(list(a.work_dir.glob("chunk-*.jsonl")))
    threads = ["--threads", str(max(1, a.threads // a.workers))] if a.threads else []
    rg.run_workers(
        [sys.executable, *sys.argv, *threads], os.environ.get("CUDA_VISIBLE_DEVICES"),
        a.workers, log=rg.log_stderr,
    )  # fmt: skip

    def finished(prompts):  # every chunk is done: only the output is written now
        raise RuntimeError("regenerate: a worker left a chunk undone")

    stats = run(finished)
    return stats | {
        "chunks_reused": done_before,
        "seconds": round(time.perf_counter() - t0, 2),
        "workers": a.workers,
        "dtype": str(dtype).removeprefix("torch."),
    }


def with_vllm(a, cfg, engine: dict, record: dict, run) -> dict:
    """Generate through a vLLM server of the verifier, started for this job."""
    from eagle3lib import regenerate as rg
    from eagle3lib import serve

    args = ["--seed", str(cfg.seed), *serve.engine_args(engine, record["trust_remote_code"])]
    env = serve.engine_env(engine.get("cpu_kvcache_gib", 1))
    with serve.VllmServer(
        a.vllm_python, record["load_path"], args, a.server_log, env, engine["startup_timeout"]
    ) as server:
        return run(rg.vllm_generate(server, cfg), lambda _width: rg.vllm_sample(server, cfg))


def answer_device_dtype(cfg):
    """The device and dtype the hf backend's verifier answers in (regenerate.dtype)."""
    import torch

    from eagle3lib.hidden_states import resolve_dtype

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return device, resolve_dtype(cfg.dtype, device, "regenerate.dtype")


def with_hf(a, cfg, record: dict, tokenizer, run) -> dict:
    """Generate with the HF verifier in this process."""
    import torch

    from eagle3lib import regenerate as rg
    from eagle3lib.verifier import device_map_for_job, load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    device, dtype = answer_device_dtype(cfg)
    model = load_model(record, dtype, device_map=device_map_for_job())
    width = json.loads(a.data)["max_length"]  # a prompt is shorter (longer ones are skipped)

    def sampler(prefix_width: int):  # synthetic prompts: a template prefix per system prompt
        return rg.hf_generate(model, tokenizer, rg.sampling(cfg), prompt_width=prefix_width)

    print(f"regenerate: the verifier answers in {dtype} on {device}", file=sys.stderr)
    stats = run(rg.hf_generate(model, tokenizer, cfg, prompt_width=width), sampler)
    return stats | {"dtype": str(dtype).removeprefix("torch.")}


if __name__ == "__main__":
    main()
