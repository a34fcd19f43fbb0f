"""The runtime attaches the flow's CUDA-graph wrappers: the whole solve per padded bucket
(:class:`~cosyvoice_runtime.flow.graphs.GraphedSolver`) and CosyVoice2's encoder
(:class:`~cosyvoice_runtime.flow.encoder_graphs.GraphedEncoder`), which the :class:`Flow` module
only holds (plain attributes) and never imports, as the vocoder does not import its own
(:func:`cosyvoice_runtime.hift.graphs.enable_graphs`); and the graphed, padded forms of the
step-by-step solve (:class:`~cosyvoice_runtime.flow.stepper.FlowStepper`) and of the incremental
streamed solve (:class:`~cosyvoice_runtime.flow.incremental.IncrementalStepper`), which the flow
otherwise makes itself, without graphs, on first use.
"""
from __future__ import annotations

from cosyvoice_runtime.flow.encoder_graphs import GraphedEncoder
from cosyvoice_runtime.flow.flow import Flow
from cosyvoice_runtime.flow.graphs import GraphedSolver, SolverBuckets
from cosyvoice_runtime.flow.incremental import IncrementalStepper
from cosyvoice_runtime.flow.stepper import FlowStepper
from cosyvoice_runtime.graph_schedule import LONG, KeyGroup


def enable_flow_graphs(flow: Flow, max_batch: int = 16, max_frames: int = 1024, capture: bool = False,
                       use_graphs: bool = True, encoder: bool = True, stepper: bool = False,
                       incremental: bool = False, incremental_compile: str | None = None,
                       incremental_fused_norms: bool = False, defer_whole_solve: bool = False) -> GraphedSolver:
    """Solve (and, for CosyVoice2 with ``encoder``, encode) through CUDA graphs per padded
    bucket from now on; with ``stepper``, the step-by-step solve too (one graph per pass); with
    ``incremental``, the incremental streamed solve (one graph per pass and
    (batch, new frames, cached frames) bucket, cached frames up to ``max_frames``).

    ``capture`` captures every bucket now (replica start-up) instead of on first use;
    ``use_graphs=False`` runs the padded buckets eagerly (CPU tests); ``incremental_compile``: the
    ``torch.compile`` backend of the incremental pass (its graphs then replay fused kernels);
    ``incremental_fused_norms``: its hand-written add + LayerNorm kernels (cosyvoice_runtime.kernels);
    ``defer_whole_solve``: the whole-solve graphs are never captured (a replica stepping its flow pass
    by pass has them serve only the warm-up's ``run_batch``, which then runs eagerly).
    """
    flow.graphed_solver = GraphedSolver(flow.decoder, max_batch=max_batch, max_frames=max_frames,
                                        use_graphs=use_graphs, deferred=defer_whole_solve)
    flow.stepper = (FlowStepper(flow.decoder, max_batch=max_batch, max_frames=max_frames, use_graphs=use_graphs)
                    if stepper else None)
    flow.incremental = None
    if incremental and flow.incremental_capable:
        flow.incremental = IncrementalStepper(flow.decoder, max_batch=max_batch, max_cached=max_frames, padded=True,
                                              use_graphs=use_graphs, compile_backend=incremental_compile,
                                              fused_norms=incremental_fused_norms)
    flow.graphed_encoder = None
    if encoder and flow.spec.family == "cosyvoice2":
        ratio = flow.spec.token_mel_ratio
        flow.graphed_encoder = GraphedEncoder(flow, max_batch=max_batch, max_tokens=max_frames // ratio,
                                              token_step=flow.graphed_solver.frame_step // ratio,
                                              use_graphs=use_graphs)
    if capture:
        capture_flow_graphs(flow)
    return flow.graphed_solver


def flow_graph_owners(flow: Flow, first_frames: int | None = None) -> list[tuple[str, object]]:
    """(name, owner) of the graphs :func:`capture_flow_graphs` captures, for
    :class:`~cosyvoice_runtime.graph_schedule.GraphSchedule` to capture instead.

    ``first_frames``: calls of up to that many frames (prompt + audio) keep the owner's name; the
    keys of longer ones go under ``<name>.long`` (:data:`~cosyvoice_runtime.graph_schedule.LONG`),
    which a replica captures after it is ready: graphs for long answers need not delay its start."""
    # with the stepper on, the whole-solve graphs serve only the odd run_batch (warm-up): not at start
    solve = ("flow.stepper", flow.stepper) if flow.stepper is not None else ("flow.solver", flow.graphed_solver)
    owners = [("flow.incremental", flow.incremental), ("flow.encoder", flow.graphed_encoder), solve]
    owners = [(name, owner) for name, owner in owners if owner is not None]
    if first_frames is None:
        return owners
    out = []
    for name, owner in owners:
        longer = _key_length(owner, first_frames)
        keys = owner.graph_keys()
        if longer is None or not any(longer(k) for k in keys):
            out.append((name, owner))
            continue
        out += [(name, KeyGroup(owner, [k for k in keys if not longer(k)])),
                (name + LONG, KeyGroup(owner, [k for k in keys if longer(k)]))]
    return out


def _key_length(owner, first_frames: int):
    """Whether a key of ``owner`` serves calls longer than ``first_frames`` frames (None: the
    owner's buckets all serve shorter ones, or it has no length in its keys)."""
    if isinstance(owner, IncrementalStepper):
        bucket = owner.bucket_of(1, 1, first_frames)
        return None if bucket is None else (lambda key: key[2] > bucket[2])  # (batch, new, cached)
    if isinstance(owner, GraphedEncoder):
        bucket = owner.bucket_of(1, first_frames // owner.flow.spec.token_mel_ratio)
        return None if bucket is None else (lambda key: key[1] > bucket[1])  # (batch, tokens)
    if isinstance(owner, SolverBuckets):  # the whole solve and its stepper
        bucket = owner.bucket_of(1, first_frames)
        return None if bucket is None else (lambda key: key[1] > bucket[1])  # (batch, frames)
    return None


def capture_flow_graphs(flow: Flow) -> int:
    """Capture every bucket of the enabled graphs now; how many graphs exist."""
    # with the stepper on, the whole-solve graphs serve only the odd run_batch (warm-up): on first use
    if flow.stepper is not None:
        n = flow.stepper.capture()
    else:
        n = flow.graphed_solver.capture() if flow.graphed_solver else 0
    n += flow.incremental.capture() if flow.incremental else 0
    return n + (flow.graphed_encoder.capture() if flow.graphed_encoder else 0)
