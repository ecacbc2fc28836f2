"""The studies of docs/study.md: one folder per study (script, protocol, committed results) and ``lib``."""
