"""Tools that measure on a GPU and write what they measured to profiles/runs/<date>-<name>/ (fp8stack.evidence), and the
pages generated from it (results.py)."""
