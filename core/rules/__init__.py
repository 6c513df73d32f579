"""The scheduling rules, one module each, imported by the cycle and by the tools
that explain its decisions (``replay/diagnose.py``)."""
