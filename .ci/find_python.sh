#!/usr/bin/env bash
# Prints the path of a Python 3 interpreter: `find_python.sh ge 12` (3.12 or newer, the default)
# or `find_python.sh eq 11` (exactly 3.11). Looks on PATH, then in pyenv's versions.
op=${1:-ge} minor=${2:-12}
cands=("python3.$minor" python3.13 python3.12 python3)
if command -v pyenv >/dev/null 2>&1; then
  for c in "$(pyenv root)"/versions/3.*/bin/python3; do cands+=("$c"); done
fi
for c in "${cands[@]}"; do
  command -v "$c" >/dev/null 2>&1 || continue
  if "$c" -c "import sys; v = sys.version_info; ok = v.minor >= $minor if '$op' == 'ge' else v.minor == $minor; sys.exit(0 if v.major == 3 and ok else 1)" 2>/dev/null; then
    command -v "$c"; exit 0
  fi
done
echo "no Python 3.$minor$([ "$op" = ge ] && echo +) found (on PATH or in pyenv)" >&2
exit 1
