#!/usr/bin/env bash
# Print the path of a Python >= 3.12 (PATH first, then pyenv's installs), or fail with a clear message.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
for c in python3.13 python3.12 python3; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then "$p" -c 'import sys; print(sys.executable)'; exit 0; fi
done
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: swajax needs Python >= 3.12; none found on PATH or in pyenv. Install one or run 'make PYTHON=/path/to/python3.12 ...'." >&2
exit 1
