"""``fastcosy doctor``: independent checks of a serving node, each with the fix for a failure.

Every check is a pure function of an :class:`Environment` (facts probed from the machine by
:func:`fastcosy_cli.doctor.probe_environment`, or written by hand in tests) and returns
:class:`CheckResult` records ``(name, status, message, fix)``. Checks never raise: a check that
crashes is reported as a failure of that check only. A ``fail`` means serving with this
configuration will not work (exit code 1); a ``warn`` means it works but something is likely
wrong or slow.

This module lists the checks in report order and runs them; the checks live by subject in
:mod:`~fastcosy_cli.doctor_system` (the node: torch, GPU, driver, wetext, Ray, memory),
:mod:`~fastcosy_cli.doctor_models` (the model directory) and :mod:`~fastcosy_cli.doctor_trt`
(TensorRT and its plans), over the types of :mod:`~fastcosy_cli.doctor_results`. Together they
import only the standard library and the standard-library-only TensorRT plan rule
(:mod:`cosyvoice_runtime.trt.plan_key`, the one the replica's loader applies) at import time, so
that doctor runs on a bare GPU node before the serving stack is installed.
"""
from __future__ import annotations

from collections.abc import Callable

from fastcosy_cli.doctor_models import check_model_dir, check_model_files, detect_family
from fastcosy_cli.doctor_results import (
    CheckResult,
    Environment,
    GpuInfo,
    Status,
    exit_code,
    format_report,
    results_json,
)
from fastcosy_cli.doctor_system import (
    arch_support,
    check_config,
    check_driver,
    check_gpu,
    check_gpu_arch,
    check_gpu_memory,
    check_pronunciation_store,
    check_ray,
    check_torch,
    check_voice_store,
    check_wetext,
)
from fastcosy_cli.doctor_trt import check_engine_cache, check_tensorrt

# What callers of the checks use (doctor, serve, the tests), from their homes.
__all__ = [
    "CHECKS", "CheckResult", "Environment", "GpuInfo", "Status", "arch_support", "check_config", "check_driver",
    "check_engine_cache", "check_gpu", "check_gpu_arch", "check_gpu_memory", "check_model_dir",
    "check_model_files", "check_pronunciation_store", "check_ray", "check_tensorrt", "check_torch",
    "check_voice_store", "check_wetext",
    "detect_family",
    "exit_code", "format_report", "results_json", "run_checks",
]

CHECKS: tuple[Callable[[Environment], CheckResult | list[CheckResult]], ...] = (
    check_config, check_torch, check_gpu, check_driver, check_gpu_arch, check_tensorrt,
    check_engine_cache, check_model_dir, check_model_files, check_voice_store, check_pronunciation_store,
    check_wetext, check_ray,
    check_gpu_memory,
)


def run_checks(env: Environment, checks=CHECKS) -> list[CheckResult]:
    """Run every check; a check that raises becomes a failure of that check alone."""
    results: list[CheckResult] = []
    for check in checks:
        name = check.__name__.removeprefix("check_")
        try:
            out = check(env)
        except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
            out = CheckResult(name, Status.FAIL, f"check crashed: {type(exc).__name__}: {exc}",
                              "report this as a bug in fastcosy doctor")
        results.extend(out if isinstance(out, list) else [out])
    return results
