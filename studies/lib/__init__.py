"""The studies' shared code (docs/study.md): the in-process asynchronous RL loop (``loop``), its
statistics (``stats``, SciPy) and the harness that runs many seeds in worker processes (``harness``).

Not part of the installed package: a study script puts the repository root on ``sys.path`` and
imports ``studies.lib``; the tests do the same through tests/conftest.py.
"""
