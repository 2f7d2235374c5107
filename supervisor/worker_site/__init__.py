"""The directory ``in_use_reporter = "torch"`` puts first on a worker's ``PYTHONPATH``.

Only its ``sitecustomize.py`` matters there (Python imports it by that name at start-up); this
file makes it importable as ``supervisor.worker_site.sitecustomize`` too, so the tests and the
leak bench use the reporter's own functions (imported under that name, it starts nothing).
"""
