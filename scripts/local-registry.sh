# Sourced by scripts that need a throwaway OCI registry on 127.0.0.1 (Debian's
# docker-registry, the reference `distribution` registry): `start_registry WORKDIR` starts one
# on a free port with its storage in WORKDIR/registry and sets REG_ADDR (host:port) and
# REG_PID; `stop_registry` stops it. Installs docker-registry and skopeo with apt when they
# are missing (as root).
ensure_registry_tools() {
  command -v docker-registry >/dev/null && command -v skopeo >/dev/null && return 0
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq docker-registry skopeo >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null && apt-get install -y -qq docker-registry skopeo >/dev/null; }
  fi
  command -v docker-registry >/dev/null || { echo "needs docker-registry and skopeo: apt-get install -y docker-registry skopeo" >&2; return 2; }
}

start_registry() {
  local work=$1 port
  ensure_registry_tools
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  mkdir -p "$work"
  cat > "$work/registry.yml" <<YML
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $work/registry
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$port
YML
  docker-registry serve "$work/registry.yml" >"$work/registry.log" 2>&1 &
  REG_PID=$!
  REG_ADDR=127.0.0.1:$port
  python3 - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/", timeout=1); sys.exit(0)
    except Exception:
        time.sleep(0.05)
sys.exit("docker-registry did not start")
PY
}

stop_registry() {
  if [ -n "${REG_PID:-}" ]; then kill "$REG_PID" 2>/dev/null || true; wait "$REG_PID" 2>/dev/null || true; REG_PID=; fi
}
