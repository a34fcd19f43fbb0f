"""HTTP application of FastCosyVoice Serve: builder, ingress, schemas, codecs, errors, metrics.

Serve config entry point: ``import_path: serve_app.app:build_app`` with ``args`` = :class:`AppArgs`.
"""
from serve_app.args import AppArgs

__all__ = ["AppArgs", "build_app"]


def build_app(args):  # lazy: importing the package must not import Ray's Serve machinery
    from serve_app.app import build_app as _build

    return _build(args)
