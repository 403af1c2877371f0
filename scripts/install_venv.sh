#!/usr/bin/env bash
# Installs requirements.txt and gridtrain (editable) into the virtual environment $1.
# uv installs the same pins as pip in half the time (it unpacks and byte-compiles in
# parallel). It is handed pip's own settings on this machine: the local wheel indexes, the
# constraints that cap torch, the CA bundle. Should uv be missing or fail, pip installs all.
set -euo pipefail
bin="$1/bin"
flags=(--python "$bin/python" --compile-bytecode --index-strategy unsafe-best-match)
while IFS= read -r line; do
  key=${line%%=*}
  key=${key#*.}
  value=${line#*=\'}
  value=${value%\'}
  case $key in
    index-url | extra-index-url | find-links | constraint)
      for v in $value; do flags+=("--$key" "$v"); done ;;
    cert) export SSL_CERT_FILE=$value ;;
  esac
done < <("$bin/python" -m pip config list 2>/dev/null)

if "$bin/python" -m pip install -q uv &&
  "$bin/uv" pip install -q "${flags[@]}" -r requirements.txt &&
  "$bin/uv" pip install -q "${flags[@]}" --no-deps -e .; then
  exit 0
fi
echo "install_venv: uv could not install; pip installs instead" >&2
"$bin/python" -m pip install -q -r requirements.txt
"$bin/python" -m pip install -q --no-deps -e .
