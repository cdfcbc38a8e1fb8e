"""What the compiler reports, shared by the parser and the checks.

* :mod:`~shardspec.findings.diagnostics`: a finding (code, severity, ``file:line:col``, the
  source line with a caret, a hint) and its rendering.
* :mod:`~shardspec.findings.codes`: every code (SS001...), its name, severity and summary.
* :mod:`~shardspec.findings.suggest`: "did you mean ...?" for hints (the closest name).
* :mod:`~shardspec.findings.catalogue`: the check catalogue (``docs/checks.md``) from them.
"""
