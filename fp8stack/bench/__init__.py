"""Tools that measure on a GPU and write what they measured to profiles/ (evidence.py)."""
