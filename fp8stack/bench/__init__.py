"""Tools that measure on a GPU and write what they measured to profiles/runs/<date>-<name>/ (evidence.py), and the
pages generated from it (results.py)."""
