"""The step-by-step flow solve (cosyvoice_runtime.flow.stepper, issue 14): rows that join at
different times and share passes at different ODE steps end with the mel of the whole solve,
and the pass picker serves the most urgent rows first."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from cosyvoice_runtime.flow.cfm import step_schedule, time_grid
from cosyvoice_runtime.flow.stepper import FlowStepper, SolveRow
from cosyvoice_runtime.stream_schedule import pick_rows
from tests.runtime.test_flow_batch import BATCH_TOL, FAMILIES, JOBS, TEST_STEPS, _flow, _item


@pytest.fixture(autouse=True)
def _no_stepper_left():
    """The flows are shared (cached) with other test modules: leave no eager stepper on them
    (a lock-holding attribute that a deepcopy of the flow elsewhere cannot copy)."""
    yield
    for family in FAMILIES:
        _flow(family).stepper = None


@pytest.mark.parametrize("family", FAMILIES)
def test_staggered_rows_equal_the_whole_solve(family):
    """Jobs join one by one; each pass takes a random subset (rows at different steps share it);
    every job's mel equals inference_batch's, per item."""
    flow = _flow(family)
    flow.stepper = None  # eager stepper, created on first use
    gen = torch.Generator().manual_seed(11)
    items = [_item(gen, flow, *job) for job in JOBS]
    whole = flow.inference_batch(items)
    rng = random.Random(5)
    waiting = list(range(len(items)))
    live: list[SolveRow] = []
    done: dict[int, torch.Tensor] = {}
    mixed_steps = False
    while waiting or live:
        if waiting and (not live or rng.random() < 0.5):
            i = waiting.pop(0)
            live += flow.start_rows([items[i]], [i])
        batch = rng.sample(live, rng.randint(1, len(live)))
        mixed_steps |= len({r.step for r in batch}) > 1
        flow.stepper.advance(batch)
        for row in [r for r in live if r.step == TEST_STEPS]:
            live.remove(row)
            done[row.tag] = flow.row_mel(row, items[row.tag].prompt_feat.shape[1])
    assert mixed_steps, "the schedule never put rows of different steps in one pass"
    for i, expected in enumerate(whole):
        assert done[i].shape == expected.shape
        err = (done[i] - expected).abs().max().item()
        assert err <= BATCH_TOL, f"{family} job {JOBS[i]}: stepped vs whole max err {err:.2e}"


def test_step_schedule_is_the_solvers_accumulation():
    """bf16: t accumulates off the grid; the schedule reproduces the loop, not the grid."""
    t_steps, dts = step_schedule(10, "cosine", torch.bfloat16, torch.device("cpu"))
    grid = time_grid(10, "cosine", torch.bfloat16, torch.device("cpu"))
    t, dt = grid[0], grid[1] - grid[0]
    for k in range(10):
        assert t_steps[k].item() == t.item() and dts[k].item() == dt.item()
        t = t + dt
        if k < 9:
            dt = grid[k + 2] - t
    assert t_steps.dtype == dts.dtype == torch.bfloat16 and t_steps.shape == (10,)


def test_a_finished_row_takes_no_pass():
    flow = _flow("cosyvoice2")
    stepper = FlowStepper(flow.decoder, use_graphs=False)
    gen = torch.Generator().manual_seed(2)
    row = flow.start_rows([_item(gen, flow, 10, 20, True, True)], [0])[0]
    for _ in range(TEST_STEPS):
        stepper.advance([row])
    with pytest.raises(ValueError, match="finished"):
        stepper.advance([row])
    with pytest.raises(ValueError, match="once per pass"):
        stepper.advance([flow.start_rows([_item(gen, flow, 10, 20, True, True)], [1])[0]] * 2)


def _rows(frames: list[int]) -> list[SolveRow]:
    z = torch.zeros(1, 1)
    return [SolveRow(mu=z, cond=z, spks=z[0], streaming=True, x=torch.zeros(80, n), tag=i)
            for i, n in enumerate(frames)]


def test_pick_rows_urgent_first_with_short_riders():
    rows = _rows([200, 1200, 180, 260, 150])
    now = 10.0
    deadline = {id(rows[0]): 10.0, id(rows[1]): 10.1, id(rows[2]): 13.0, id(rows[3]): 14.0, id(rows[4]): 15.0}
    # rows 0 and 1 are due within the slack; 1 is too long to pad row 0 to (ratio 2), so the pass
    # is row 0 plus the riders no longer than it (2 and 4), in deadline order
    assert [r.tag for r in pick_rows(rows, deadline, now, 0.5, 16, 2.0)] == [0, 2, 4]
    assert [r.tag for r in pick_rows(rows, deadline, now, 0.5, 2, 2.0)] == [0, 2]
    # token2wav.rider_ratio: riders up to 1.5 x the urgent row's 200 frames (row 3's 260 rides,
    # row 1's 1200 never does: the length ratio caps the pass at 400)
    assert [r.tag for r in pick_rows(rows, deadline, now, 0.5, 16, 2.0, rider_ratio=1.5)] == [0, 2, 3, 4]
    assert [r.tag for r in pick_rows(rows, deadline, now, 0.5, 16, 2.0, rider_ratio=8.0)] == [0, 2, 3, 4]


def test_pick_rows_runs_one_kind_per_pass():
    """Recomputed and incremental rows are separate graphs: a pass takes the most urgent row's kind."""
    rows = _rows([200, 180, 150, 170])
    rows[1].kind = rows[3].kind = "incremental"  # instance attributes over the class's "recompute"
    deadline = {id(r): 10.0 + 0.1 * i for i, r in enumerate(rows)}
    assert [r.tag for r in pick_rows(rows, deadline, 10.0, 0.5, 16, 2.0)] == [0, 2]
    deadline[id(rows[3])] = 9.0
    assert [r.tag for r in pick_rows(rows, deadline, 10.0, 0.5, 16, 2.0)] == [3, 1]


def test_pick_rows_without_urgency_batches_by_deadline_and_length():
    rows = _rows([300, 1200, 500, 700])
    deadline = {id(r): 20.0 + i for i, r in enumerate(rows)}
    assert [r.tag for r in pick_rows(rows, deadline, 10.0, 0.5, 16, 2.0)] == [0, 2]
    assert pick_rows([], {}, 0.0, 0.5, 16) == []


def test_device_and_dtype_follow_a_cast_and_a_swapped_estimator():
    """A stepper reads its estimator's device and dtype from a parameter it looked up once
    (SolverGraphs._first_weight): a cast in place (Module.to) shows at once, and a solver whose
    estimator was replaced (a mode's compiled or TensorRT one) is asked again."""
    solver = copy.deepcopy(_flow(FAMILIES[0]).decoder)
    stepper = FlowStepper(solver, use_graphs=False)
    assert stepper.dtype == torch.float32 and stepper.device == torch.device("cpu")
    solver.estimator.to(torch.float64)
    assert stepper.dtype == torch.float64
    solver.estimator = torch.nn.Linear(2, 2).to(torch.float16)
    assert stepper.dtype == torch.float16


def test_pick_rows_keeps_rows_no_bucket_holds_in_passes_of_their_own():
    """A pass takes its largest row's shape: a row past every captured bucket (it runs eagerly) would
    take the graphed rows beside it into an eager pass; it gets passes with its like instead."""
    rows = _rows([200, 180, 150, 170])
    rows[1].oversize = rows[3].oversize = True
    deadline = {id(r): 10.0 + 0.1 * i for i, r in enumerate(rows)}
    assert [r.tag for r in pick_rows(rows, deadline, 10.0, 0.5, 16, 2.0)] == [0, 2]
    deadline[id(rows[1])] = 9.0
    assert [r.tag for r in pick_rows(rows, deadline, 10.0, 0.5, 16, 2.0)] == [1, 3]
    assert not SolveRow.oversize  # rows are alike unless Token2Wav.start_solves says otherwise
