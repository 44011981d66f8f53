"""eagle3lib.graphed_step on a CPU: what can be checked without a GPU (the capture itself
needs one: bench/train.py's ours_ffd_graph variant runs it)."""

import pytest
import torch

from eagle3lib.graphed_step import capturable_optimizers, copy_into, detached


def test_copy_into_writes_the_captured_tensors_in_place():
    static = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 3}
    held = static["input_ids"]
    copy_into(static, {"input_ids": torch.tensor([[1, 2, 3, 4]]), "ttt_steps": 3})
    assert static["input_ids"] is held  # the graph reads this memory
    assert held.tolist() == [[1, 2, 3, 4]]
    static["error_records"] = 0  # the loop logs the host batch's count, not the graph's
    copy_into(static, {"input_ids": torch.ones(1, 4, dtype=torch.long), "ttt_steps": 3,
                       "error_records": 2})  # fmt: skip
    assert held.tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"input_ids": torch.zeros(1, 5, dtype=torch.long), "ttt_steps": 3}, "'input_ids'"),
        ({"input_ids": torch.zeros(1, 4), "ttt_steps": 3}, "one shape"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 2}, "changed from 3"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, "keys"),
    ],
)
def test_copy_into_refuses_what_the_graph_did_not_capture(batch, message):
    static = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "ttt_steps": 3}
    with pytest.raises(ValueError, match=message):
        copy_into(static, batch)
    assert static["input_ids"].sum() == 0


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")
def test_adamw_becomes_capturable_and_its_scheduler_fills_the_rate_in_place():
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params, lr=0.5, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    capturable_optimizers([opt], torch.device("cpu"))
    group = opt.param_groups[0]
    rate = group["lr"]
    assert group["capturable"] is True
    assert isinstance(rate, torch.Tensor) and rate.item() == 0.5
    assert rate.dtype == torch.float32
    sched.step()
    assert group["lr"] is rate  # the captured step reads this tensor
    assert rate.item() == 0.25


def test_optimisers_other_than_fused_adamw_are_refused_by_name():
    muon = torch.optim.Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.02)
    with pytest.raises(ValueError, match="Muon cannot be captured"):
        capturable_optimizers([muon], torch.device("cpu"))
    unfused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.5)
    with pytest.raises(ValueError, match="must be fused"):
        capturable_optimizers([unfused], torch.device("cpu"))


def test_an_eager_steps_outputs_leave_their_autograd_history_behind():
    weight = torch.nn.Parameter(torch.ones(2))
    loss = (weight * 2).sum()
    metrics = {"loss": loss * 1, "steps": 3}
    out_loss, out_metrics = detached((loss, metrics))
    assert loss.grad_fn is not None and out_loss.grad_fn is None
    assert out_metrics["loss"].grad_fn is None and out_metrics["steps"] == 3
    assert out_loss.item() == 4.0
