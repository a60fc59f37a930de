#!/usr/bin/env bash
# Make a Debian test host ready to run the compose deploy (bench/deploy.py, RUNBOOK.md): Docker Engine
# from Debian's packages, started without a bridge (no container ever gets a private-range address;
# every service uses host networking on loopback), debootstrap for the stand-in images, and Compose v2.
# Compose v2 is needed because the graders' containers ask for systempaths=unconfined, which Compose
# 1.x (bookworm's docker-compose 1.29) cannot pass. Where no v2 is installed, the Compose plugin of
# Debian's next release (a static Go binary, libc only) is taken from the same mirror apt already uses
# here, and installed as a Docker CLI plugin. Root only; idempotent.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 2; }

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  nohup dockerd --bridge=none --iptables=false --ip-masq=false >/var/log/flywheel-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start: /var/log/flywheel-dockerd.log" >&2; exit 1; }
fi

compose_v2() { docker compose version 2>/dev/null | grep -q "version v\?2"; }
if ! compose_v2; then
  . /etc/os-release
  next="trixie"  # the Debian release after bookworm, whose docker-compose is Compose v2
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/parts" "$work/lists/partial" "$work/archives/partial"
  # this host's own Debian sources (its mirror, its keyring), the release renamed
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    name="$(basename "$f")"; [ "$name" = sources.list ] && name=host.list
    sed "s/$VERSION_CODENAME/$next/g" "$f" > "$work/parts/$name"
  done
  opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/parts" -o "APT::Sandbox::User=root"
        -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives")
  apt-get "${opts[@]}" update -qq
  (cd "$work" && apt-get "${opts[@]}" download -qq docker-compose)
  dpkg -x "$work"/docker-compose_*.deb "$work/x"
  install -D -m 0755 "$work/x/usr/libexec/docker/cli-plugins/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
  compose_v2 || { echo "Compose v2 did not install" >&2; exit 1; }
fi
docker compose version
