"""``fastcosy doctor``'s checks of the model directory: the official file set of its family and
files that would not load (checksums when the directory lists them, else structural checks)."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

from cosyvoice_runtime.trt.plan_key import sha256_file
from fastcosy_cli.doctor_results import CheckResult, Environment, Status

# Official file set per family (design spec §8.1); paths relative to the model directory.
_COMMON_REQUIRED = ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "CosyVoice-BlankEN/config.json",
                    "CosyVoice-BlankEN/tokenizer_config.json")
REQUIRED_FILES = {
    "cosyvoice2": ("cosyvoice2.yaml", *_COMMON_REQUIRED, "speech_tokenizer_v2.onnx"),
    "cosyvoice3": ("cosyvoice3.yaml", *_COMMON_REQUIRED, "speech_tokenizer_v3.onnx"),
}
# The tokenizer is either the slow pair or a fast tokenizer.json (both appear in the wild).
_TOKENIZER_ALTERNATIVES = (("CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt"),
                           ("CosyVoice-BlankEN/tokenizer.json",))
CHECKSUMS_FILE = "checksums.json"
# ONNX files are parsed (catches truncation) only up to this size; larger ones are size-checked.
_ONNX_PARSE_LIMIT_BYTES = 64 * 1024**2


def detect_family(model_dir: Path) -> str | None:
    found = [f for f, files in REQUIRED_FILES.items() if (model_dir / files[0]).exists()]
    return found[0] if len(found) == 1 else None


def check_model_dir(env: Environment) -> CheckResult:
    d = env.model_dir
    if d is None and not env.tiny_allowed:
        return CheckResult("model_dir", Status.FAIL, "no model directory configured and the config does not ask for "
                           "the tiny model: the replicas will refuse to start",
                           "set model_dir in the config (or $FAST_COSY_MODEL_DIR) to an official CosyVoice2-0.5B / "
                           "Fun-CosyVoice3-0.5B directory, or tiny_family for the random-weight test model")
    if d is None:
        return CheckResult("model_dir", Status.WARN, "no model directory configured: the tiny RANDOM-WEIGHT model is "
                           "served (valid audio, not speech)",
                           "set model_dir in the config (or $FAST_COSY_MODEL_DIR) to an official CosyVoice2-0.5B / "
                           "Fun-CosyVoice3-0.5B directory")
    if not d.is_dir():
        return CheckResult("model_dir", Status.FAIL, f"model directory {d} does not exist",
                           "download the model there or fix model_dir (it is resolved on each replica's node)")
    if (d / "cosyvoice.yaml").exists() and detect_family(d) is None:
        return CheckResult("model_dir", Status.FAIL, f"{d} is a CosyVoice v1 (300M) directory, which is not supported",
                           "use CosyVoice2-0.5B or Fun-CosyVoice3-0.5B")
    family = detect_family(d)
    if family is None:
        return CheckResult("model_dir", Status.FAIL, f"{d} has neither or both of cosyvoice2.yaml / cosyvoice3.yaml",
                           "point model_dir at one official model directory (the yaml name selects the family)")
    missing = [f for f in REQUIRED_FILES[family] if not (d / f).is_file()]
    if not any(all((d / f).is_file() for f in alt) for alt in _TOKENIZER_ALTERNATIVES):
        missing.append("CosyVoice-BlankEN/vocab.json + merges.txt (or tokenizer.json)")
    if missing:
        return CheckResult("model_dir", Status.FAIL, f"{family} directory {d} is missing: {', '.join(missing)}",
                           "re-download the model directory (docs/troubleshooting.md lists the official file set)")
    # No flow.decoder.estimator.fp32.onnx needed: fastcosy build-trt exports the estimator from flow.pt.
    return CheckResult("model_dir", Status.OK, f"{family} file set complete in {d}")


def _file_problem(path: Path) -> str | None:
    """Why a model file cannot load (cheap structural checks), or None."""
    size = path.stat().st_size
    if size == 0:
        return "empty"
    if path.suffix == ".pt":
        # torch.save writes a zip archive; a truncated download loses its central directory.
        try:
            with zipfile.ZipFile(path) as zf:
                zf.namelist()
        except zipfile.BadZipFile:
            return "not a readable torch archive (truncated or corrupt download)"
    elif path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return "not valid JSON"
    elif path.suffix == ".onnx" and size <= _ONNX_PARSE_LIMIT_BYTES:
        try:
            import onnx

            onnx.load_model(str(path), load_external_data=False)
        except ImportError:
            return None
        except Exception as exc:  # noqa: BLE001 - protobuf DecodeError and friends
            return f"does not parse as ONNX ({type(exc).__name__})"
    return None


def check_model_files(env: Environment) -> CheckResult:
    d = env.model_dir
    family = detect_family(d) if d is not None and d.is_dir() else None
    if family is None:
        return CheckResult("model_files", Status.OK, "skipped (no complete model directory)")
    sums_path = d / CHECKSUMS_FILE
    bad: list[str] = []
    if sums_path.is_file():
        try:
            sums = json.loads(sums_path.read_text())
        except ValueError:
            return CheckResult("model_files", Status.FAIL, f"{sums_path} is not valid JSON",
                               "restore it from the model's source, or delete it to fall back to structural checks")
        if not env.verify_checksums:
            return CheckResult("model_files", Status.OK, f"{len(sums)} files listed in {CHECKSUMS_FILE}; "
                               "hashes not verified (--no-checksums)")
        for rel, digest in sorted(sums.items()):
            p = d / rel
            if not p.is_file():
                bad.append(f"{rel} (missing)")
            elif sha256_file(p) != digest:
                bad.append(f"{rel} (checksum mismatch)")
        what = f"{len(sums)} files match {CHECKSUMS_FILE}"
    else:
        files = [*REQUIRED_FILES[family], *(f for alt in _TOKENIZER_ALTERNATIVES for f in alt)]
        for rel in files:
            p = d / rel
            if p.is_file() and (why := _file_problem(p)):
                bad.append(f"{rel} ({why})")
        what = f"model files non-empty and structurally readable (no {CHECKSUMS_FILE} to compare against)"
    if bad:
        return CheckResult("model_files", Status.FAIL, f"damaged model files in {d}: {', '.join(bad)}",
                           "re-download the named files (a partial download is the usual cause)")
    return CheckResult("model_files", Status.OK, what)
