"""The report of a run: reading its run directory (run_data), the plots (plots) and report.md (build)."""
