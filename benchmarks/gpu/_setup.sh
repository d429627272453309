# Shared start of the benchmarks/gpu/*.sh scripts; source it with the script's arguments:
#   . "$(dirname "$0")/_setup.sh" "$@"
# Takes --out DIR (required, created, made absolute), makes WORK a temporary folder removed on exit,
# and puts the repository (the current folder) first on PYTHONPATH, with unbuffered Python output.
set -u
_usage="usage: bash $0 --out DIR"
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "$_usage" >&2; exit 2; }; OUT="$2"; shift 2 ;;
    *) echo "$_usage" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "$_usage" >&2; exit 2; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "/tmp/fastdata-$(basename "$0" .sh).XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
