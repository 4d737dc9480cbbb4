#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or explain on stderr and exit 1.
# Looks at $PYTHON, python3.12/python3/python3.13 on PATH, then pyenv versions (3.12 first: the
# GPU machines run 3.12 and megatron-core ships cp312 wheels).
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for cand in ${PYTHON:-} python3.12 python3 python3.13; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then command -v "$cand"; exit 0; fi
done
root="${PYENV_ROOT:-$HOME/.pyenv}"
for cand in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -Vr) $(ls -d "$root"/versions/3.1[3-9]* 2>/dev/null | sort -V); do
  if [ -x "$cand/bin/python3" ] && ok "$cand/bin/python3"; then echo "$cand/bin/python3"; exit 0; fi
done
echo "make's .venv needs Python >= 3.12 (the tests use megatron-core, which requires it) and found none:" \
     "checked \$PYTHON, python3.12, python3, python3.13 on PATH and $root/versions." \
     "Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
exit 1
