"""Flow matching token-to-mel models (CV2 conformer + causal U-Net, CV3 DiT) and their solver."""
from cosyvoice_runtime.flow.cfm import CFMSolver, fixed_noise, time_grid
from cosyvoice_runtime.flow.flow import Flow, FlowItem, build_flow

__all__ = ["CFMSolver", "Flow", "FlowItem", "build_flow", "fixed_noise", "time_grid"]
