#!/usr/bin/env bash
# Installs FreeToken into a virtual environment of its own, with the torch build this machine
# needs and the CPU expert kernel already built.
#
#   packaging/install.sh [--prefix DIR] [--bin DIR] [--torch cpu|cuda] [--source SRC]
#                        [--wheels DIR] [--service]
#
#   --prefix   where the environment goes (default: /opt/freetoken as root, else
#              ~/.local/share/freetoken); the environment is PREFIX/venv
#   --bin      where the `freetoken` command is linked (default: /usr/local/bin as root,
#              else ~/.local/bin)
#   --torch    cpu or cuda (default: cuda where nvidia-smi finds a GPU, cpu otherwise)
#   --source   what to install: this checkout (default), a wheel, or a pip requirement
#   --wheels   a folder of wheels to install from first (an offline machine)
#   --service  as root: a `freetoken` service user and the systemd unit, enabled and started
#
# FREETOKEN_TORCH_VERSION pins torch (default below); PYTHON picks the interpreter (3.11+).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
torch_version=${FREETOKEN_TORCH_VERSION:-2.13.0}
# PyTorch's index of CPU-only wheels: PyPI's Linux torch is a CUDA build that brings ~15
# NVIDIA packages (several GB) a machine without a GPU never uses.
cpu_index=https://download.pytorch.org/whl/cpu
python=${PYTHON:-python3}
if [ "$(id -u)" -eq 0 ]; then prefix=/opt/freetoken bin=/usr/local/bin
else prefix=${XDG_DATA_HOME:-$HOME/.local/share}/freetoken bin=$HOME/.local/bin; fi
source_spec=$(dirname "$here") torch= wheels= service=
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) prefix=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --torch) torch=$2; shift 2 ;;
    --source) source_spec=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --service) service=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
say() { printf '>>> %s\n' "$*" >&2; }

if [ -z "$torch" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then torch=cuda
  else torch=cpu; fi
fi
# pip retries an index it cannot reach for every package it looks up (minutes, on a machine
# that sees only PyPI or a mirror): ask once, quickly, and use pip's own index where it fails
reachable() {
  "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" \
    >/dev/null 2>&1
}
case $torch in
  cpu)
    say "no GPU found: torch $torch_version, CPU build"
    if reachable "$cpu_index/torch/"; then torch_source=(--extra-index-url "$cpu_index")
    else
      torch_source=()
      say "PyTorch's CPU index does not answer: torch from pip's own index (on Linux, PyPI's is the CUDA build)"
    fi ;;
  cuda) torch_source=(); say "GPU found: torch $torch_version, CUDA build" ;;
  *) echo "install.sh: --torch is cpu or cuda, not $torch" >&2; exit 2 ;;
esac
pip_from=()
[ -n "$wheels" ] && pip_from=(--find-links "$wheels")

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "install.sh: FreeToken needs Python 3.11 or newer ($python is older)" >&2; exit 1; }
venv=$prefix/venv
say "environment: $venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet "${pip_from[@]}")
# torch first and pinned, so the package's own `torch>=` is already met by the right build
"${pip[@]}" "${torch_source[@]}" "torch==$torch_version"
say "installing FreeToken from $source_spec"
"${pip[@]}" "$source_spec"
say "building the CPU expert kernel (once per machine)"
"$venv/bin/freetoken" doctor --build >/dev/null \
  || say "the CPU kernel did not build; plain torch serves CPU experts (freetoken doctor says why)"
mkdir -p "$bin"
ln -sf "$venv/bin/freetoken" "$bin/freetoken"
say "$("$venv/bin/freetoken" --version 2>/dev/null)"

if [ -n "$service" ]; then
  [ "$(id -u)" -eq 0 ] || { echo "install.sh: --service needs root" >&2; exit 1; }
  id freetoken >/dev/null 2>&1 \
    || useradd --system --user-group --home-dir /var/lib/freetoken --create-home \
         --shell /usr/sbin/nologin freetoken
  sed "s#/opt/freetoken/venv#$venv#g" "$here/freetoken.service" >/etc/systemd/system/freetoken.service
  # the kernel built above goes where the service looks for it
  install -d -o freetoken -g freetoken /var/lib/freetoken/cache
  FREETOKEN_CACHE_DIR=/var/lib/freetoken/cache "$venv/bin/freetoken" doctor --build >/dev/null || true
  chown -R freetoken:freetoken /var/lib/freetoken
  systemctl daemon-reload
  systemctl enable --now freetoken
  say "service started: systemctl status freetoken; logs: journalctl -u freetoken"
else
  say "done: run 'freetoken serve' (add $bin to PATH if it is not), then 'freetoken doctor'"
fi
