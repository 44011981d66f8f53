"""Hidden states from a vLLM server (extract.backend: vllm): its extract_hidden_states method
with the hidden-states KV connector, one request per sample, written into one shard."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3lib.errors import UserError
from eagle3lib.hidden_states import iter_progress, writer_stats
from eagle3lib.shard_writer import ShardWriter
from eagle3lib.shards import ShardLayout


def vllm_extraction_args(layer_ids: Sequence[int], storage: Path, cuda: bool) -> list[str]:
    """Server flags for vLLM's extract_hidden_states method (what speculators launches)."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if not cuda:
        connector["kv_connector"] = "CpuHiddenStatesConnector"
        connector["kv_connector_module_path"] = "eagle3lib.vllm_connector"
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(connector)]


def fetch_states(server, sample: np.ndarray, i: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """Sample ``i``'s states [len, layers, hidden] from the server: one completion request,
    then the file its connector wrote (read under its lock, then removed)."""
    import fcntl

    from safetensors.torch import load_file

    out = server.completion(sample.tolist(), max_tokens=1)
    path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise UserError(
            "vLLM returned no hidden_states_path: is the extraction connector configured?"
        )
    with open(path + ".lock", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # the connector holds LOCK_EX until the file is written
        data = load_file(path)
    for leftover in (path, path + ".lock"):
        Path(leftover).unlink(missing_ok=True)
    if data["token_ids"].tolist() != sample.tolist():
        raise UserError(f"vLLM hidden states of sample {i} belong to other tokens")
    states = data["hidden_states"]
    if tuple(states.shape) != shape:
        raise UserError(f"vLLM returned states of shape {tuple(states.shape)} for sample {i}")
    return states


def extract_samples_vllm(
    server,
    samples: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    layout_hidden: int,
    n_layers: int,
    cfg,
    shard_path: Path,
    metadata: dict[str, str],
) -> dict[str, Any]:
    """Hidden states from a vLLM server (extract_hidden_states + the KV connector), one
    request per sample, ``cfg.concurrency`` in flight, written into one shard in place."""
    import concurrent.futures

    lengths = tuple(len(s) for s in samples)
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])  # longest first
    layout = ShardLayout(lengths, n_layers, layout_hidden, tuple(order), cfg.storage)
    writer = ShardWriter(shard_path, layout, metadata)

    def fetch(i: int) -> torch.Tensor:
        return fetch_states(server, samples[i], i, (lengths[i], n_layers, layout_hidden))

    t0 = time.perf_counter()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.concurrency)
    try:
        # At most 2 x concurrency samples in flight or waiting to be written: memory stays
        # bounded whatever the shard's size.
        window = 2 * cfg.concurrency
        futures = {i: pool.submit(fetch, i) for i in order[:window]}
        for n, i in enumerate(iter_progress([(i, lengths[i]) for i in order], layout.tokens)):
            if n + window < len(order):
                nxt = order[n + window]
                futures[nxt] = pool.submit(fetch, nxt)
            states = futures.pop(i).result()
            writer.put_batch([i], states[None], [lengths[i]])
        sha256 = writer.close(np.concatenate(samples), np.concatenate(masks))
    except BaseException:
        # the requests under way are not waited for: they end once the caller stops the server
        pool.shutdown(wait=False, cancel_futures=True)
        writer.abort()
        raise
    pool.shutdown()
    return writer_stats(writer, time.perf_counter() - t0, 0, sha256)


def extract_with_vllm(
    ids: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    record: dict[str, Any],
    layer_ids: list[int],
    dtype: torch.dtype,
    cfg,
    shard_path: Path,
    metadata: dict[str, str],
    engine: dict[str, Any] | None,
    vllm_python: str | None,
) -> dict[str, Any]:
    """Start a vLLM server with ``vllm_python`` (the config's ``vllm`` section as ``engine``)
    for the verifier in ``dtype`` and write the shard from it; its states' folder is removed."""
    from eagle3lib import serve

    storage = shard_path.parent / f".vllm-{shard_path.stem}"
    engine = {
        **(engine or {}),
        "dtype": str(dtype).removeprefix("torch."),  # the same numerics as the hf backend
        "max_model_len": max(len(t) for t in ids) + 8,
    }
    args = [
        *vllm_extraction_args(layer_ids, storage.resolve(), torch.cuda.is_available()),
        *serve.engine_args(engine, record.get("trust_remote_code", False)),
    ]
    env = serve.engine_env(engine.get("cpu_kvcache_gib", 1))
    log_path = shard_path.parent / f"vllm-server-{shard_path.stem}.log"
    timeout = engine.get("startup_timeout", 900)  # vllm.startup_timeout, as every vLLM job's
    try:
        with serve.VllmServer(
            vllm_python, record["load_path"], args, log_path, env, timeout
        ) as server:
            return extract_samples_vllm(
                server, ids, masks, record["hidden_size"], len(layer_ids), cfg, shard_path, metadata
            )
    finally:
        shutil.rmtree(storage, ignore_errors=True)
