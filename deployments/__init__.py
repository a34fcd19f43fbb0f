"""Model-serving deployments (no HTTP): text frontend (CPU) and synthesizer (GPU).

Handle-level messages and errors live in :mod:`deployments.protocol`; environment variables are
read only in :mod:`deployments.constants`.
"""
__all__ = ["autoscaling_policy", "frontend", "protocol", "synthesizer"]
