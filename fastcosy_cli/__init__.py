"""``fastcosy``, the operator's command line, and ``fastcosy doctor``'s checks.

The top layer of the project (``fastcosy_cli -> bench -> serve_app -> deployments ->
cosyvoice_runtime``, checked by import-linter): it drives the service and the offline tools and
nothing imports it. Importing this package imports nothing else, so ``fastcosy doctor`` runs on a
node before the serving stack is installed.

Console script: ``fastcosy = fastcosy_cli.main:main``; ``python -m fastcosy_cli`` is the same.
"""
